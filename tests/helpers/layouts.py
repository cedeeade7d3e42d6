"""The calibrations measured on a 2-core AMD EPYC (results/plan/layouts/calibration: its 1-thread
engines of the default 1P1D and its 2-thread colocated engine), filed where `pdserve plan layout`
and `pdserve serve --layout auto` look for this host's."""

from __future__ import annotations

import shutil
from pathlib import Path

from pdserve_core.roofline.stepmodel import device_key

MEASURED = Path(__file__).resolve().parents[2] / "results/plan/layouts/calibration"
MODEL = "SmolLM2-135M-Instruct-bfloat16"


def file_measured_calibrations(root: Path, dtype: str = "bfloat16") -> Path:
    """Copy them under `root` as this host's CPU; `dtype` other than bfloat16 files the same
    figures under that dtype's name (an AVX2-only host serves float32: the choice's plumbing is
    what is tested there, not its figures)."""
    for measured in sorted(MEASURED.glob("cpu-*-*t")):
        threads = int(measured.name.rsplit("-", 1)[1].removesuffix("t"))
        target = root / device_key(threads=threads)
        target.mkdir(parents=True, exist_ok=True)
        for path in measured.glob("*-bfloat16.json"):
            shutil.copy(path, target / path.name.replace("-bfloat16", f"-{dtype}"))
    return root
