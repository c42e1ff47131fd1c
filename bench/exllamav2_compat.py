"""Files in both directions between ExLlamaV2 0.3.2 and exl_core, checked by each other's forward.

Two halves, because ExLlamaV2 needs CUDA and exl_core's tests run on CPUs:

  prepare (here, CPU):  python bench/exllamav2_compat.py prepare --work .exlv2
      a tiny random Llama (2 layers, hidden 256, 512-token BPE vocabulary trained on the calibration
      text) in fp16, and exl_core's own EXL2 (4.0 bpw) and GPTQ (4-bit g32 act-order) conversions of it.
  device (GPU, exllamav2 wheel on PYTHONPATH):  python bench/exllamav2_compat.py device --work .exlv2 --out $OUT
      converts the tiny model with ExLlamaV2's own converter, and with ExLlamaV2's forward computes
      logits of fixed token ids on (a) its own EXL2 folder, (b) exl_core's EXL2 folder, (c) exl_core's
      GPTQ folder; stores ExLlamaV2's dequantised weights of (a). Everything goes to one tar file.
  unpack (here):  python bench/exllamav2_compat.py unpack --tar FILE
      writes the fixture tests/data/exllamav2/ used by tests/test_exllamav2_files.py.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "data" / "exllamav2"
IDS_SEED, IDS_SHAPE = 1234, (2, 48)
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def fixed_ids() -> torch.Tensor:
    return torch.randint(3, SHAPE["vocab_size"], IDS_SHAPE, generator=torch.Generator().manual_seed(IDS_SEED))


def _tokenizer(folder: Path, text: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=SHAPE["vocab_size"],
                                                        special_tokens=["<unk>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "model_max_length": 2048,
         "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True}))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                "unk_token": "<unk>"}))


def prepare(work: Path) -> None:
    from exl_core.quantize.convert import convert_main
    from exl_core.testing import make_tiny_model
    work.mkdir(parents=True, exist_ok=True)
    src = work / "src"
    if not (src / "config.json").exists():
        make_tiny_model(src, "llama", seed=3, **SHAPE)
        _tokenizer(src, Path("/work/shared/data/calib_c4.utf8").read_text()[:400_000])
        # fp16 on disk, as a converter's input usually is
        from safetensors.torch import load_file, save_file
        f = src / "model.safetensors"
        save_file({k: v.half() for k, v in load_file(f).items()}, f, metadata={"format": "pt"})
        cfg = json.loads((src / "config.json").read_text())
        cfg["torch_dtype"] = "float16"
        (src / "config.json").write_text(json.dumps(cfg, indent=2))
    for name, extra in (("ours_exl2", ["-b", "4.0", "--head-bits", "6"]),
                        ("ours_gptq", ["--format", "gptq", "--bits", "4", "--group-size", "32", "--act-order", "--asym"])):
        if not (work / name / "config.json").exists():
            rc = convert_main(["-i", str(src), "-o", str(work / name), "--rows", "8", "--length", "128",
                               "--threads", "1", "-q", *extra])
            if rc:
                sys.exit(rc)
    torch.save(fixed_ids(), work / "ids.pt")
    print(f"prepared {work}: src, ours_exl2, ours_gptq")


def _exlv2_logits(folder: Path, ids: torch.Tensor, weights: bool = False):
    from exllamav2 import ExLlamaV2, ExLlamaV2Config
    cfg = ExLlamaV2Config(str(folder))
    cfg.arch_compat_overrides()
    model = ExLlamaV2(cfg)
    model.load()
    # No cache: without flash-attn, ExLlamaV2's cache-less forward attends bidirectionally (seen on
    # the H200); tests/test_exllamav2_files.py compares it with an unmasked reference accordingly.
    with torch.inference_mode():
        logits = model.forward(ids).float().cpu()     # ExLlamaV2 embeds on the CPU: ids stay there
    dq = {}
    if weights:
        for key, mod in model.modules_dict.items():
            if hasattr(mod, "get_weight_tensor_dq") and getattr(mod, "q_handle", None) is not None:
                dq[key] = mod.get_weight_tensor_dq().cpu().contiguous()   # (in, out), fp16 as ExLlamaV2 makes it
    model.unload()
    return logits, dq


def device(work: Path, out: Path) -> None:
    from safetensors.torch import save_file
    ids = fixed_ids()
    conv, job = work / "exlv2_conv", work / "exlv2_job"
    shutil.rmtree(job, ignore_errors=True)
    cmd = [sys.executable, "-m", "exllamav2.conversion.convert_exl2", "-i", str(work / "src"), "-o", str(job),
           "-cf", str(conv), "-b", "4.0", "-hb", "6", "-r", "16", "-mr", "8", "-l", "256", "-ml", "256"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    tensors = {"ids": ids}
    for name, folder in (("exlv2", conv), ("ours_exl2", work / "ours_exl2"), ("ours_gptq", work / "ours_gptq")):
        try:
            logits, dq = _exlv2_logits(folder, ids, weights=name == "exlv2")
        except Exception as e:  # noqa: BLE001 - a folder ExLlamaV2 refuses is a finding, not a crash
            print(f"ExLlamaV2 could not run {name}: {type(e).__name__}: {e}", flush=True)
            continue
        tensors[f"{name}.logits"] = logits
        tensors.update({f"{name}.dq.{k}": v for k, v in dq.items()})
        print(f"{name}: logits {tuple(logits.shape)}, {len(dq)} dequantised weights", flush=True)
    save_file(tensors, str(conv / "exllamav2_reference.safetensors"),
              metadata={"exllamav2": "0.3.2", "ids_seed": str(IDS_SEED), "ids_shape": json.dumps(IDS_SHAPE)})
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out / "exllamav2_compat.tar", "w") as tar:
        for f in sorted(conv.iterdir()):
            if f.is_file():
                tar.add(f, arcname=f"exlv2_conv/{f.name}")
        for name in ("ours_exl2", "ours_gptq"):
            for f in sorted((work / name).iterdir()):
                if f.is_file():
                    tar.add(f, arcname=f"{name}/{f.name}")
    print(f"wrote {out / 'exllamav2_compat.tar'}")


def unpack(tar_path: Path) -> None:
    shutil.rmtree(FIXTURE, ignore_errors=True)
    FIXTURE.mkdir(parents=True)
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            if m.isfile() and ".." not in m.name and not m.name.startswith("/"):
                tar.extract(m, FIXTURE, filter="data")
    print(f"fixture in {FIXTURE}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["prepare", "device", "unpack"])
    ap.add_argument("--work", type=Path, default=ROOT / ".exlv2")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tar", type=Path, default=None)
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.mode == "prepare":
        prepare(a.work)
    elif a.mode == "device":
        device(a.work, a.out or Path("."))
    else:
        unpack(a.tar)


if __name__ == "__main__":
    main()
