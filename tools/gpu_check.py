"""The learner's GPU path (``--device cuda``), checked and timed on a machine with a CUDA GPU.

    python tools/gpu_check.py [--nets NAME ...] [--repeat 5] [--json]
    python tools/gpu_check.py --quick [--json]     # tiny batches, one timed update

For each preset network of ``tools/bench.py update`` (shmrl's PolicyNet and PPO of the
env's preset, on a fake batch of its shapes):

1. **the same losses**: a PPO on the CPU and one on the GPU, from the same weights and
   seed, each make the batch (``PPO.make_batch``) and take one update (``PPO.update``) on
   it, whose minibatches are the same (the same seed draws the same permutations); the
   advantages, the update's losses and diagnostics, and the weights after it agree to
   float tolerance (convolutions on the GPU run in TF32, as the learner runs them: a
   looser tolerance for the CNN);
2. **resuming across devices**: a checkpoint the GPU's PPO writes (``resume.save_checkpoint``,
   the learner's own) resumes on the CPU (``load_resume_checkpoint``, ``PPO.set_state``)
   with the same weights, Adam state and seed state, bit for bit, and one the CPU's
   writes resumes on the GPU likewise;
3. **times**: ``bench.py update``'s measurement on the CPU and on the GPU, per network.

Without a GPU it says so and exits 0 with ``--quick`` (what a test runs), 1 without.
Exit status 1 also when a check fails.
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/gpu_check.py`: run as tools.gpu_check
    import run_as_module
    run_as_module.run(__file__)

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tools.shared import finished, print_method, started
from tools.update_bench import CASE_NAMES, CASES, case_config, fake_messages, measure

# (relative, absolute) tolerance of what the CPU and the GPU compute: losses and weights
# after a whole update (many Adam steps), and advantages.
TOLERANCE = {"mlp": (1e-2, 1e-3), "cnn": (5e-2, 5e-3)}
STATS = ("pi_loss", "v_loss", "entropy", "approx_kl", "clip_frac")


def same_losses(case, quick: bool) -> dict:
    """Check 1 for ``case``: the largest differences and whether each is within tolerance."""
    import numpy as np

    from shmrl.core.episode import EpisodeBatch
    from shmrl.model.ppo import PPO, host
    from shmrl.trainer.setup import policy_net

    spec, config = case_config(case, quick)
    net = policy_net(config, spec)
    rtol, atol = TOLERANCE["cnn" if net.convolutional else "mlp"]
    chunks = EpisodeBatch.concat(fake_messages(net, config))
    cpu, gpu = PPO(net, config, seed=0, device="cpu"), PPO(net, config, seed=0, device="cuda")
    batches = cpu.make_batch(chunks), gpu.make_batch(chunks)
    results = cpu.update(batches[0]), gpu.update(batches[1])
    diffs = {"advantages": float(np.abs(batches[0].advantages - batches[1].advantages).max()),
             "weights": float(np.abs(host(cpu.optimizer.flat) - host(gpu.optimizer.flat)).max())}
    diffs.update({k: abs(results[0][k] - results[1][k]) for k in STATS})
    scale = {"advantages": float(np.abs(batches[0].advantages).max()),
             "weights": float(np.abs(host(cpu.optimizer.flat)).max()), **{k: abs(results[0][k]) for k in STATS}}
    failed = [k for k, d in diffs.items() if not d <= atol + rtol * scale[k]]
    return {"net": case.name, "max_abs_diff": diffs, "rtol": rtol, "atol": atol, "ok": not failed,
            "failed": failed, "cpu_stats": {k: results[0][k] for k in STATS}}


def resume_across(case, quick: bool) -> dict:
    """Check 2 for ``case``: a checkpoint of the GPU's PPO resumed on the CPU, and back."""
    import numpy as np

    from shmrl.config.settings import env_name, saved_config
    from shmrl.core.episode import EpisodeBatch
    from shmrl.model.ppo import PPO, host
    from shmrl.server.store import DEFAULT_POLICY, EpisodeStore
    from shmrl.trainer.resume import load_resume_checkpoint, policy_arrays, ppo_state, save_checkpoint
    from shmrl.trainer.setup import policy_net

    spec, config = case_config(case, quick)
    net = policy_net(config, spec)
    chunks = EpisodeBatch.concat(fake_messages(net, config))
    nets, saved = {DEFAULT_POLICY: net}, saved_config(config)

    def state_of(ppo) -> list:
        opt = ppo.optimizer
        return [host(opt.flat), host(opt.exp_avg), host(opt.exp_avg_sq), opt.t, ppo.rng.bit_generator.state]

    def round_trip(source, device: str) -> bool:
        with tempfile.TemporaryDirectory(prefix="shmrl-gpu-check-") as folder:
            save_checkpoint(Path(folder), 1, 1, EpisodeStore(), {DEFAULT_POLICY: source}, saved, 1, False)
            _, arrays, state = load_resume_checkpoint(folder, env_name(config.env), config.hidden, nets, False, saved)
        resumed = PPO(net, config, seed=1, device=device)
        resumed.set_state(policy_arrays(arrays, ""), ppo_state(state, DEFAULT_POLICY, False))
        before, after = state_of(source), state_of(resumed)
        return (all(np.array_equal(a, b) for a, b in zip(before[:3], after[:3])) and before[3:] == after[3:]
                and resumed.optimizer.flat.device.type == device)

    gpu = PPO(net, config, seed=0, device="cuda")
    gpu.update(gpu.make_batch(chunks))
    cuda_to_cpu = round_trip(gpu, "cpu")
    cpu = PPO(net, config, seed=0, device="cpu")
    cpu.update(cpu.make_batch(chunks))
    cpu_to_cuda = round_trip(cpu, "cuda")
    return {"net": case.name, "cuda_to_cpu": cuda_to_cpu, "cpu_to_cuda": cpu_to_cuda,
            "ok": cuda_to_cpu and cpu_to_cuda}


def guarded(check, case, quick: bool) -> dict:
    """``check(case, quick)``, or where it raises, a failed entry that says why: one network's
    failure is reported with the others' results, not instead of them."""
    try:
        return check(case, quick)
    except Exception as e:   # noqa: BLE001 - reported, and the check fails
        return {"net": case.name, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}


def gpu_check(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    cases = [c for c in CASES if c.name in args.nets]
    result = started(
        "gpu_check",
        "per preset network of tools/bench.py update: (1) PPO on the CPU and on the GPU from the same "
        "weights and seed, each PPO.make_batch + one PPO.update on the same fake batch (the same "
        "minibatches): advantages, losses and weights after it within tolerance; (2) a checkpoint "
        "written by resume.save_checkpoint from the GPU's PPO resumed on the CPU (load_resume_checkpoint, "
        "PPO.set_state) and back, weights, Adam state and seed state bit for bit; (3) bench.py update's "
        f"times on both ({args.repeat} timed updates after {args.warmup}; {args.threads} CPU thread(s))"
        + ("; --quick: tiny batches, one epoch" if args.quick else ""),
        nets=[c.name for c in cases], repeat=args.repeat, warmup=args.warmup, threads=args.threads, quick=args.quick)
    result.update(torch=torch.__version__, torch_cuda=torch.version.cuda, gpu=torch.cuda.is_available())
    if not result["gpu"]:
        result.update(ok=args.quick, checks=[], resumes=[], times=[])
        return finished(result)
    result["device_name"] = torch.cuda.get_device_name(0)
    result["checks"] = [guarded(same_losses, c, args.quick) for c in cases]
    result["resumes"] = [guarded(resume_across, c, args.quick) for c in cases]
    result["times"] = [guarded(lambda c, quick: {"net": c.name, "cpu": measure(c, "cpu", args.repeat, args.warmup, quick),
                                                 "cuda": measure(c, "cuda", args.repeat, args.warmup, quick)},
                               c, args.quick) for c in cases]
    result["ok"] = all(x["ok"] for x in result["checks"] + result["resumes"]) and \
        not any("error" in x for x in result["times"])
    return finished(result)


def print_gpu_check(r: dict) -> None:
    if not r["gpu"]:
        print(f"gpu_check: no CUDA GPU here (torch {r['torch']}, "
              f"{'a CPU build' if r['torch_cuda'] is None else 'CUDA ' + r['torch_cuda'] + ', no GPU found'}): "
              "nothing to check")
        return
    print(f"gpu_check on {r['device_name']} (torch {r['torch']}, CUDA {r['torch_cuda']}): "
          f"{'all checks pass' if r['ok'] else 'A CHECK FAILED'}")
    print("  same losses on the same minibatches, CPU against GPU (largest absolute difference):")
    for x in r["checks"]:
        if "error" in x:
            print(f"    {x['net']:<12} FAILED: {x['error']}")
            continue
        d = x["max_abs_diff"]
        print(f"    {x['net']:<12} {'ok' if x['ok'] else 'FAILED ' + ', '.join(x['failed']):<8} "
              + ", ".join(f"{k} {v:.2e}" for k, v in d.items()) + f" (rtol {x['rtol']:g}, atol {x['atol']:g})")
    print("  a checkpoint resumed across devices (weights, Adam state, seed state equal):")
    for x in r["resumes"]:
        if "error" in x:
            print(f"    {x['net']:<12} FAILED: {x['error']}")
            continue
        print(f"    {x['net']:<12} cuda -> cpu {'ok' if x['cuda_to_cpu'] else 'FAILED'}, "
              f"cpu -> cuda {'ok' if x['cpu_to_cuda'] else 'FAILED'}")
    print(f"  ms per update (median; {r['params']['threads']} CPU thread(s)):")
    print(f"    {'network':<12} | {'cpu':>9} | {'cuda':>9} | {'cpu/step':>8} | {'cuda/step':>9} | {'speed-up':>8}")
    for x in r["times"]:
        if "error" in x:
            print(f"    {x['net']:<12} FAILED: {x['error']}")
            continue
        c, g = x["cpu"], x["cuda"]
        print(f"    {x['net']:<12} | {c['total_ms']:>9.2f} | {g['total_ms']:>9.2f} | "
              f"{c['per_gradient_step_ms']:>8.3f} | {g['per_gradient_step_ms']:>9.3f} | "
              f"{c['total_ms'] / g['total_ms']:>7.2f}x")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nets", nargs="+", choices=CASE_NAMES, default=list(CASE_NAMES), help="networks to check")
    p.add_argument("--repeat", type=int, default=None, help="timed updates per network and device (default: 5, "
                   "--quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed updates first (default: 1, --quick 0)")
    p.add_argument("--threads", type=int, default=1, help="torch's CPU threads (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny batches, one timed update: checks that it works")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    args = p.parse_args(argv)
    args.repeat = args.repeat if args.repeat is not None else (1 if args.quick else 5)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.quick else 1)
    if args.repeat <= 0 or args.warmup < 0 or args.threads <= 0:
        p.error("--repeat and --threads must be > 0, --warmup >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = gpu_check(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_gpu_check(result)
        print_method(result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
