// The chain modes of bench/gemv_probe.cu: the extension's GPTQ decode launches as a chain of layers against variants of
// one or more launches, rounds alternated (`h2`, `ring`, `chain`, `fit`, `wave`, `sg`, `fold`, `cap`; NOTES, stops 45-53).  Included
// by gemv_probe.cu after its launchers and layer_row; each returns main's exit code.
#pragma once

// `rounds` rounds of: the extension's chain, the mode's variants (a callable), the read floor; main's exit code.
template <class F>
int ab_rounds(int rounds, F variants) {
  for (int round = 0; round < rounds; ++round) {
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 8>>("GPTQ as the extension");
    variants();
    layer_row<ReadLauncher, ReadLauncher, ReadLauncher, ReadLauncher>("read floor");
  }
  return 0;
}

// Mode `chain`: the extension's chain and the read floor, for A/B builds (stop 50)
int chain_run() {
  check_row<KsLauncher<8, 4>>();
  check_row<KsLauncher<16, 4>>();
  check_row<KsLauncher<16, 8>>();
  return ab_rounds(3, [] {});
}

// Mode `fit`: blocks that fit beside the launch before's (stop 50)
int fit_run() {
  // Registers allocated (8 a thread) an SM: q/k/v and gate/up k8 r4 3 x 20,480 of 65,536; o k16 r4 49,152 and down
  // k16 r8 53,248 leave no room for a block of the next launch.  By this probe's plain build's counts (k12 r4 75,
  // k12 r8 96, k8 r8 97): o on 12 warps 30,720 (a gate/up block fits beside it, and it enters beside one q/k/v
  // block), down on 12 warps 36,864 (a q/k/v block fits beside it), on 8 warps 26,624.
  check_row<KsLauncher<12, 4>>();
  check_row<KsLauncher<12, 8>>();
  check_row<KsLauncher<8, 8>>();
  return ab_rounds(5, [&] {
    layer_row<KsLauncher<8, 4>, KsLauncher<12, 4>, KsLauncher<8, 4>, KsLauncher<16, 8>>("ext, o k12");
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<12, 8>>("ext, down k12");
    layer_row<KsLauncher<8, 4>, KsLauncher<12, 4>, KsLauncher<8, 4>, KsLauncher<12, 8>>("ext, o and down k12");
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<8, 8>>("ext, down k8");
  });
}

// Mode `h2`: scale and zero as one half2 (4 bytes) against fp32's 8, in turn
int h2_run() {
  for (auto& l : g_layers)
    for (W* w : {&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down}) make_h2(*w);
  CK(cudaDeviceSynchronize());
  check_row<KsLauncher<8, 4, true, 2, false, true>>();
  check_row<KsLauncher<16, 4, true, 2, false, true>>();
  check_row<KsLauncher<16, 8, true, 2, false, true>>();
  using A = KsLauncher<8, 4, true, 2, false, true>;
  using B = KsLauncher<16, 4, true, 2, false, true>;
  using D = KsLauncher<16, 8, true, 2, false, true>;
  return ab_rounds(5, [&] {
    layer_row<A, B, A, D>("GPTQ ext, half2 scale/zero", g_layers, 4.0);
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, D>("GPTQ ext, half2 down only", g_layers,
                                                                        8.0 - 4.0 * 11008.0 * 4096 / kLayerParams);
  });
}

// Mode `ring`: ring depth per launch, rounds alternated (stop 49)
int ring_run() {
  return ab_rounds(5, [&] {
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 8>, KsLauncher<8, 4>, KsLauncher<16, 8>>("ext, o ring 8");
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<8, 4>, KsLauncher<16, 4>>("ext, down ring 4");
  });
}

// Mode `wave`: gate/up (688 tiles) on 4-warp blocks, six an SM: one wave, against 8-warp blocks, three an SM: a full
// wave and a 73 % one (stop 51; the extension's EXL_CORE_KSLICE_ONE_WAVE)
int wave_run() {
  check_row<KsLauncher<4, 4>>();
  check_row<KsLauncher<4, 8>>();
  return ab_rounds(5, [&] {
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<4, 4>, KsLauncher<16, 8>>("ext, gate/up k4 r4");
    layer_row<KsLauncher<8, 4>, KsLauncher<16, 4>, KsLauncher<4, 8>, KsLauncher<16, 8>>("ext, gate/up k4 r8");
  });
}

// Mode `sg`: what the in-kernel act-order gather (sgather: x copied whole into shared memory, each warp gathering its
// slice) costs q/k/v and gate/up in the chain -- against the EXL2 path's separate permuted-norm launch (3.24 and 3.26
// us a layer of adds, stop 39's timeline), the price of a norm folded into an act-order consumer (stop 51)
int sg_run() {
  std::vector<Layer> hybrid = g_layers;       // o and down as GPTQ's; q/k/v and gate/up with a random act-order
  for (auto& l : hybrid) {
    l.q = make_weight(4096, 4096, false, 1), l.k = make_weight(4096, 4096, false, 1);
    l.v = make_weight(4096, 4096, false, 1);
    l.gate = make_weight(4096, 11008, false, 1), l.up = make_weight(4096, 11008, false, 1);
  }
  using S = KsLauncher<8, 4, true, 2, true>;
  std::vector<Layer> permuted{{make_weight(4096, 4096, false, 1), make_weight(4096, 4096, false, 1),
                               make_weight(4096, 4096, false, 1), make_weight(4096, 4096, false, 1),
                               make_weight(4096, 11008, false, 1), make_weight(4096, 11008, false, 1),
                               make_weight(11008, 4096, false, 1)}};
  check_row<S>(permuted);                     // its gather against the reference's (o and down with a permutation)
  return ab_rounds(5, [&] {
    layer_row<S, KsLauncher<16, 4>, S, KsLauncher<16, 8>>("ext, q/k/v and gate/up sgather", hybrid);
    using G = KsLauncher<8, 4>;               // gate/up on permuted weights without sgather: the global gather
    layer_row<S, KsLauncher<16, 4>, G, KsLauncher<16, 8>>("ext, q/k/v sgather, gate/up gathers from global", hybrid);
  });
}

// The extension's GPTQ batch-1 launches as it ran them in stops 51-52 (gate/up one wave of 4-warp blocks, not capped:
// since stop 53 it runs mode cap's U6 / UF6), and its folded-norm consumers (probe_fold: r = 1, weight 1).
using ExtQ = KsLauncher<8, 4>;
using ExtO = KsLauncher<16, 4>;
using ExtU = KsLauncher<4, 4>;
using ExtD = KsLauncher<16, 8>;
using ExtQF = KsLauncher<8, 4, true, 2, false, false, true>;
using ExtUF = KsLauncher<4, 4, true, 2, false, false, true>;
// gate/up as the extension has launched it since stop 53: at most 6 blocks an SM (wave_cap_smem)
using ExtU6 = KsLauncher<4, 4, true, 2, false, false, false, 6>;
using ExtUF6 = KsLauncher<4, 4, true, 2, false, false, true, 6>;

// Mode `fold`: what the folded norm costs its consumers in the chain (stop 53).  Call 2 (7d97dd3) read the plain chain
// at 47.70-48.00 us a layer against 50.55-50.62 folded, where the model's fold wins (stop 27: it removes a norm launch).
// Until stop 55 its gate/up launches were not capped: the kw 4 fold instance at 72 registers fit 7 blocks an SM, where
// the extension runs 6.  In stop 55 call 3 the builds whose instance took 80 registers (6 an SM) read the folded chain
// at 48.62-48.90 us a layer, the one at 72 (7 an SM; stop 54's early-sums form) 49.86-50.06.
// The capped rows are the extension's; the uncapped ones stay for comparison with stops 53-55.
int fold_run() {
  check_row<ExtQF>();                         // r = 1, weight 1: the folded launches against the same reference
  check_row<ExtUF>();
  check_row<ExtUF6>();
  return ab_rounds(3, [&] {
    layer_row<ExtQ, ExtO, ExtU, ExtD>("ext (gate/up k4)");
    layer_row<ExtQF, ExtO, ExtUF, ExtD>("ext, folded q/k/v, gate/up");
    layer_row<ExtQF, ExtO, ExtU, ExtD>("ext, folded q/k/v");
    layer_row<ExtQ, ExtO, ExtUF, ExtD>("ext, folded gate/up");
    layer_row<ExtQ, ExtO, ExtU6, ExtD>("ext cap 6 (gate/up k4)");
    layer_row<ExtQF, ExtO, ExtUF6, ExtD>("ext cap 6, folded q/k/v, gate/up");
  });
}

// Mode `cap`: gate/up's 688 one-wave blocks with at most 6 (or 5) an SM (stop 53).  Under PDL they enter while o's
// blocks still run: call 2's stamps (STAMP_CHAIN=k4) put 7 blocks on 81-82 SMs and 2 on 41-43, whose loops ended ~4 us
// earlier (by my reading the SMs that free first fill to 7).  A cap spreads them (688 = 5.2 an SM); the extension's wave_cap_smem.
int cap_run() {
  using U6 = KsLauncher<4, 4, true, 2, false, false, false, 6>;
  using U5 = KsLauncher<4, 4, true, 2, false, false, false, 5>;
  using UF6 = KsLauncher<4, 4, true, 2, false, false, true, 6>;
  check_row<U6>();
  check_row<U5>();
  check_row<UF6>();
  return ab_rounds(4, [&] {
    layer_row<ExtQ, ExtO, ExtU, ExtD>("ext (gate/up k4)");
    layer_row<ExtQ, ExtO, U6, ExtD>("ext, gate/up k4 cap 6");
    layer_row<ExtQ, ExtO, U5, ExtD>("ext, gate/up k4 cap 5");
    layer_row<ExtQF, ExtO, ExtUF, ExtD>("ext, folded");
    layer_row<ExtQF, ExtO, UF6, ExtD>("ext, folded, gate/up cap 6");
  });
}
