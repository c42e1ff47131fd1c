// The host side of bench/gemv_probe.cu's trace modes (stop 49): `stamps` (-DKSLICE_STAMPS: every warp's phase times
// in the chain, bench/stamps_report.py reads the CSV) and `tailpf` (-DKSLICE_TAIL_PREFETCH: the chain with and without
// each launch's L2 prefetch of the next launch's first weights).  Included by gemv_probe.cu after its launchers and
// layers; the device hooks are gemv_probe_hooks.cuh.
#pragma once

#ifdef KSLICE_LAUNCH_IDS
int launch_id(W* w) {
  static char* arena = nullptr;                                // read once (the CSV dump asks per row)
  if (!arena) CK(cudaMemcpyFromSymbol(&arena, launch_ids::g_arena, sizeof arena));
  return static_cast<int>((reinterpret_cast<char*>(w->y) - arena) >> 16);
}
#endif

#if defined(KSLICE_STAMPS) || defined(KSLICE_TAIL_PREFETCH)
// One replay's worth of "GPTQ as the extension": q/k/v -> o -> gate/up -> down over the 8 layers (both modes here).
// STAMP_CHAIN=k4: gate/up on 4-warp blocks (the extension's one wave, stop 51), =k4cap6 at most 6 of them an SM;
// =fold: also q/k/v and gate/up with the folded norm (probe_fold), as the extension runs GPTQ's batch 1 (stop 53).
void ext_chain(cudaStream_t st) {
  static const std::string chain = getenv("STAMP_CHAIN") ? getenv("STAMP_CHAIN") : "";
  for (auto& l : g_layers) {
    if (chain == "fold") KsLauncher<8, 4, true, 2, false, false, true>::go(Op{&l.q, &l.k, &l.v}, g_x4096, st);
    else KsLauncher<8, 4>::go(Op{&l.q, &l.k, &l.v}, g_x4096, st);
    KsLauncher<16, 4>::go(Op{&l.o}, g_x4096, st);
    if (chain == "fold") KsLauncher<4, 4, true, 2, false, false, true>::go(Op{&l.gate, &l.up}, g_x4096, st);
    else if (chain == "k4") KsLauncher<4, 4>::go(Op{&l.gate, &l.up}, g_x4096, st);
    else if (chain == "k4cap6") KsLauncher<4, 4, true, 2, false, false, false, 6>::go(Op{&l.gate, &l.up}, g_x4096, st);
    else KsLauncher<8, 4>::go(Op{&l.gate, &l.up}, g_x4096, st);
    KsLauncher<16, 8>::go(Op{&l.down}, g_x11008, st);
  }
}

#endif

#ifdef KSLICE_TAIL_PREFETCH
// The chain's next launch for each launch of "GPTQ as the extension" (q/k/v -> o -> gate/up -> down -> the next
// layer's q/k/v; the last layer's down -> the first layer's q/k/v, as a replay follows the one before), or none.
template <int KW, int R>
tailpf::NextOp next_op(const Op& op) {
  tailpf::NextOp nx{};
  nx.n = static_cast<int>(op.size());
  nx.kw = KW, nx.ring = R, nx.n_chunks = op[0]->K / 32;
  int tiles = 0;
  for (int i = 0; i < nx.n; ++i) {
    nx.m[i] = {op[i]->qw, op[i]->N, tiles};
    tiles += (op[i]->N + 31) / 32;
  }
  nx.tiles = tiles;
  return nx;
}
void set_tail_prefetch(bool on) {
  std::vector<tailpf::NextOp> table(launch_ids::kIds);
  if (on)
    for (int L = 0; L < kLayers; ++L) {
      Layer& l = g_layers[L];
      Layer& nl = g_layers[(L + 1) % kLayers];
      table[launch_id(&l.q)] = next_op<16, 4>(Op{&l.o});
      table[launch_id(&l.o)] = next_op<8, 4>(Op{&l.gate, &l.up});
      table[launch_id(&l.gate)] = next_op<16, 8>(Op{&l.down});
      table[launch_id(&l.down)] = next_op<8, 4>(Op{&nl.q, &nl.k, &nl.v});
    }
  CK(cudaMemcpyToSymbol(tailpf::c_next, table.data(), table.size() * sizeof(tailpf::NextOp)));
}
// Mode `tailpf`: the chain with and without the tail prefetches, rounds alternated (per-launch rows would prefetch
// for a launch that does not follow, so only chains).
int tailpf_run() {
  for (int round = 0; round < 6; ++round)
    for (int on = 0; on < 2; ++on) {
      const int o = round % 2 ? 1 - on : on;
      set_tail_prefetch(o != 0);
      const float us = time_seq(ext_chain) / kLayers;
      printf("GPTQ as the extension, tail prefetch %-3s chain %6.2f us/layer\n", o ? "on" : "off", us);
      printf("JSON {\"tailpf\": %d, \"round\": %d, \"chain_us_per_layer\": %.2f}\n", o, round, us);
    }
  set_tail_prefetch(false);
  return 0;
}
#endif

#ifdef KSLICE_STAMPS
// Mode `stamps`: the chain "GPTQ as the extension" replayed from a graph, then once more with every warp's phase
// stamps kept (qgemm_kslice_kernel.cuh's EXL_KSLICE_STAMP: 0 entry, 1 before the PDL wait, 2 after it, 3 x staged,
// 4 loop done, 5 after the block's reduction barrier, 6 exit).  Per launch of the middle layers: when its warps
// pass each phase (us from the layer's first q/k/v entry, globaltimer) and how long each phase takes a warp.
int stamp_run() {
  using namespace stamps;
  const size_t n = static_cast<size_t>(kIds) * kBlocks * kWarps * kPhases;
  unsigned long long* t;
  long long* c;
  unsigned* sm;
  CK(cudaMalloc(&t, n * 8));
  CK(cudaMalloc(&c, n * 8));
  CK(cudaMalloc(&sm, static_cast<size_t>(kIds) * kBlocks * 4));
  CK(cudaMemcpyToSymbol(g_t, &t, sizeof t));
  CK(cudaMemcpyToSymbol(g_c, &c, sizeof c));
  CK(cudaMemcpyToSymbol(g_sm, &sm, sizeof sm));
  const float us = time_seq(ext_chain) / kLayers;
  printf("stamped chain (GPTQ as the extension, STAMP_CHAIN=%s) %.2f us/layer\n",
         getenv("STAMP_CHAIN") ? getenv("STAMP_CHAIN") : "", us);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  ext_chain(st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (int r = 0; r < 5; ++r) CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  CK(cudaMemset(t, 0, n * 8));
  CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  std::vector<unsigned long long> ht(n);
  std::vector<long long> hc(n);
  std::vector<unsigned> hsm(static_cast<size_t>(kIds) * kBlocks);
  CK(cudaMemcpy(ht.data(), t, n * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hc.data(), c, n * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hsm.data(), sm, hsm.size() * 4, cudaMemcpyDeviceToHost));
  // clock64 cycles per ns, from every warp's entry-to-exit span
  double cyc = 0, ns = 0;
  std::vector<unsigned long long> deltas;
  for (size_t w = 0; w < n / kPhases; ++w) {
    const size_t b = w * kPhases;
    if (ht[b] && ht[b + 6]) {
      cyc += hc[b + 6] - hc[b], ns += ht[b + 6] - ht[b];
      for (int p = 1; p <= 6; ++p)
        if (ht[b + p] > ht[b + p - 1]) deltas.push_back(ht[b + p] - ht[b + p - 1]);
    }
  }
  std::sort(deltas.begin(), deltas.end());
  const double cpn = cyc / ns;
  printf("clock %.3f GHz (clock64 / globaltimer over warps' spans); smallest globaltimer steps %llu %llu %llu ns\n",
         cpn, deltas.size() > 0 ? deltas[0] : 0ull, deltas.size() > 10 ? deltas[10] : 0ull,
         deltas.size() > 100 ? deltas[100] : 0ull);
  auto pct = [](std::vector<double> v, double q) {
    if (v.empty()) return -1.0;
    std::sort(v.begin(), v.end());
    return v[std::min(v.size() - 1, static_cast<size_t>(q * (v.size() - 1) + 0.5))];
  };
  const char* names[4] = {"q/k/v", "o", "gate/up", "down"};
  if (const char* path = getenv("STAMP_CSV")) {               // every stamped warp of layers 3 and 4, ns
    FILE* f = fopen(path, "w");
    fprintf(f, "layer,op,block,warp,sm,t0,t1,t2,t3,t4,t5,t6\n");
    for (int L = 3; L <= 4; ++L) {
      Layer& l = g_layers[L];
      W* ws[4] = {&l.q, &l.o, &l.gate, &l.down};
      for (int op = 0; op < 4; ++op)
        for (int b = 0; b < kBlocks; ++b)
          for (int w = 0; w < kWarps; ++w) {
            const int id = launch_id(ws[op]);
            const size_t s = ((static_cast<size_t>(id) * kBlocks + b) * kWarps + w) * kPhases;
            if (!ht[s]) continue;
            fprintf(f, "%d,%s,%d,%d,%u", L, names[op], b, w, hsm[static_cast<size_t>(id) * kBlocks + b]);
            for (int p = 0; p < 7; ++p) fprintf(f, ",%llu", ht[s + p]);
            fprintf(f, "\n");
          }
    }
    fclose(f);
  }
  for (int L = 2; L < kLayers - 1; ++L) {
    Layer& l = g_layers[L];
    const int ids[4] = {launch_id(&l.q), launch_id(&l.o), launch_id(&l.gate), launch_id(&l.down)};
    unsigned long long t0 = ~0ull;
    for (size_t i = 0; i < static_cast<size_t>(kBlocks) * kWarps; ++i) {
      const unsigned long long v = ht[(static_cast<size_t>(ids[0]) * kBlocks * kWarps + i) * kPhases];
      if (v) t0 = std::min(t0, v);
    }
    printf("layer %d (us from its q/k/v launch's first warp entry; per-warp phase spans from clock64)\n", L);
    for (int op = 0; op < 4; ++op) {
      std::vector<double> at[7], span[6];
      std::vector<int> per_sm(1024, 0);
      int blocks = 0;
      for (int b = 0; b < kBlocks; ++b) {
        bool any = false;
        for (int w = 0; w < kWarps; ++w) {
          const size_t s = ((static_cast<size_t>(ids[op]) * kBlocks + b) * kWarps + w) * kPhases;
          if (!ht[s]) continue;
          any = true;
          for (int p = 0; p < 7; ++p) at[p].push_back((static_cast<double>(ht[s + p]) - t0) / 1e3);
          for (int p = 0; p < 6; ++p) span[p].push_back((hc[s + p + 1] - hc[s + p]) / cpn / 1e3);
        }
        if (any) ++blocks, ++per_sm[hsm[static_cast<size_t>(ids[op]) * kBlocks + b] & 1023];
      }
      const int sms_used = static_cast<int>(std::count_if(per_sm.begin(), per_sm.end(), [](int v) { return v > 0; }));
      printf("  %-8s blocks %4d on %3d SMs | entry %6.2f %6.2f %6.2f | waited %6.2f %6.2f %6.2f | staged %6.2f | "
             "loop done %6.2f %6.2f | exit %6.2f %6.2f\n",
             names[op], blocks, sms_used, pct(at[0], 0), pct(at[0], 0.5), pct(at[0], 1), pct(at[2], 0),
             pct(at[2], 0.5), pct(at[2], 1), pct(at[3], 0.5), pct(at[4], 0.5), pct(at[4], 1), pct(at[6], 0.5),
             pct(at[6], 1));
      printf("           spans (median / p90) prologue %5.2f/%5.2f wait %5.2f/%5.2f stage %5.2f/%5.2f loop %5.2f/%5.2f "
             "reduce %5.2f/%5.2f epilogue %5.2f/%5.2f\n",
             pct(span[0], .5), pct(span[0], .9), pct(span[1], .5), pct(span[1], .9), pct(span[2], .5),
             pct(span[2], .9), pct(span[3], .5), pct(span[3], .9), pct(span[4], .5), pct(span[4], .9),
             pct(span[5], .5), pct(span[5], .9));
      printf("JSON {\"stamps\": \"%s\", \"layer\": %d, \"blocks\": %d, \"entry_us\": [%.3f, %.3f, %.3f], "
             "\"waited_us\": [%.3f, %.3f, %.3f], \"staged_us\": %.3f, \"loop_done_us\": [%.3f, %.3f], "
             "\"exit_us\": [%.3f, %.3f], \"span_median_us\": [%.3f, %.3f, %.3f, %.3f, %.3f, %.3f]}\n",
             names[op], L, blocks, pct(at[0], 0), pct(at[0], 0.5), pct(at[0], 1), pct(at[2], 0), pct(at[2], 0.5),
             pct(at[2], 1), pct(at[3], 0.5), pct(at[4], 0.5), pct(at[4], 1), pct(at[6], 0.5), pct(at[6], 1),
             pct(span[0], .5), pct(span[1], .5), pct(span[2], .5), pct(span[3], .5), pct(span[4], .5),
             pct(span[5], .5));
    }
  }
  return 0;
}
#endif
