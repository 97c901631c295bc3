"""What a run ran on: versions, cores, threads, device, git commit."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git(*args: str) -> str:
    import dynamo_dist

    try:  # the checkout the benchmarked dynamo_dist was imported from
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(dynamo_dist.__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def load_average() -> list[float] | None:
    """1, 5 and 15 minute load averages (runnable processes; compare with the core count)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(device: torch.device, world_size: int) -> dict:
    info = {
        "load_average_end": load_average(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "device": str(device),
        "world_size": world_size,
        "intra_op_threads_per_rank": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "dynamo_dist": os.path.dirname(os.path.abspath(__import__("dynamo_dist").__file__)),
        # BENCH_SOURCE_COMMIT names the commit of a checkout without git metadata (git archive)
        "git_commit": _git("rev-parse", "HEAD") or os.environ.get("BENCH_SOURCE_COMMIT", ""),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
