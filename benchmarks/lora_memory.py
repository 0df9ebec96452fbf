"""Peak memory of LoRA against full fine-tuning: the same SFT steps on a ~90M-parameter stand-in, on CPU.

    .venv/bin/python benchmarks/lora_memory.py --workdir /tmp/lora-memory [--steps 4] [--batch-size 8]

Builds the stand-in once (`models.standin`, Qwen2, width 1024, 8 layers) in the workdir, then trains it with
`train_sft` twice, each in a fresh process so one peak cannot hide the other: in full (fp32 weights, grads
and two AdamW moments) and with LoRA (r=8 on every linear layer, merged on save). A process's peak resident
memory is the kernel's high-water mark, VmHWM in /proc/self/status: tracemalloc and resource.getrusage miss
or blur torch's allocations. Printed per mode: the resident memory once torch, transformers, TRL, peft and
datasets are imported (the floor all share), the peak up to the last training step, the peak including the
save, and those peaks above the floor. The weights stay mapped from the safetensors file, so
they count once the first forward pass touches them: the same ~345 MiB in both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# ~89M parameters: big enough that weights and optimizer state dwarf activations and the libraries.
BIG = dict(hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, intermediate_size=2816,
           max_position_embeddings=512)


def status_kib(field: str) -> int:
    """A /proc/self/status memory figure (VmHWM: peak resident, VmRSS: now), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}: this measurement needs Linux")


def child(mode: str, model: str, out: str, steps: int, batch_size: int) -> None:
    """One training run; prints a JSON line of its memory figures."""
    import datasets  # noqa: F401: everything train_sft imports is in before the floor is read
    import peft  # noqa: F401
    import torch
    from trl import SFTTrainer  # noqa: F401

    from components.training.lora import LoraParams
    from components.training.sft import SFTParams, train_sft

    torch.set_num_threads(1)
    floor = status_kib("VmRSS")
    t0 = time.perf_counter()
    examples = [{"prompt": f"{a}+{b}-{c}\n", "completion": f"{a}+{b}={a + b}\n{a + b}-{c}={a + b - c}\n"
                                                          f"#### {a + b - c}\n"}
                for a in range(10) for b in range(10) for c in range(2)]
    trained: list[int] = []  # the peak when the last step is logged: training, before the save
    m = train_sft(model, examples, out, SFTParams(max_steps=steps, batch_size=batch_size, learning_rate=1e-4,
                                                  logging_steps=steps, lora=LoraParams() if mode == "lora" else None),
                  progress_callback=lambda step, total, loss: trained.append(status_kib("VmHWM")))
    print(json.dumps({"mode": mode, "train_peak_kib": trained[-1], "peak_kib": status_kib("VmHWM"),
                      "floor_kib": floor, "train_s": time.perf_counter() - t0, "steps": m["steps"]}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--child", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, str(args.workdir / args.child), args.steps, args.batch_size)
        return

    from components.models.standin import StandinConfig, build_standin, domain_texts, param_count

    model = args.workdir / "standin"
    if not (model / "model.safetensors").exists():
        build_standin(model, domain_texts("arith", n_per_level=100), StandinConfig(**BIG), seed=0)
    print(f"stand-in {model}: {param_count(model) / 1e6:.1f}M parameters; {args.steps} SFT steps of batch "
          f"{args.batch_size} on CPU, one thread")
    rows = {}
    for mode in ("full", "lora"):
        r = subprocess.run([sys.executable, __file__, "--workdir", str(args.workdir), "--steps", str(args.steps),
                            "--batch-size", str(args.batch_size), "--child", mode, "--model", str(model)],
                           capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        if r.returncode != 0:
            sys.exit(f"{mode} run failed:\n{r.stderr[-3000:]}")
        rows[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    mib = 1024
    print("MiB resident: peak in training (to the last step), peak with the save, and both above the floor")
    print(f"{'mode':6s} {'floor':>7s} {'train':>7s} {'+save':>7s} {'train-floor':>12s} {'+save-floor':>12s} "
          f"{'seconds':>8s}")
    for mode, r in rows.items():
        floor = r["floor_kib"]
        print(f"{mode:6s} {floor / mib:7.0f} {r['train_peak_kib'] / mib:7.0f} {r['peak_kib'] / mib:7.0f} "
              f"{(r['train_peak_kib'] - floor) / mib:12.0f} {(r['peak_kib'] - floor) / mib:12.0f} {r['train_s']:8.1f}")
    full, lora = (rows[m]["train_peak_kib"] - rows[m]["floor_kib"] for m in ("full", "lora"))
    print(f"in training, LoRA's peak above the floor is {lora / full:.0%} of full fine-tuning's")


if __name__ == "__main__":
    main()
