"""The optimizer step's model: what a profile says ``torch.optim.SGD(momentum=0.9).step()`` costs
(``t = fixed_s + n_tensors * t0_s + param_bytes * s_per_byte``, the pseudo op class
``optimizer_step``; measured and fitted by ``calibrate.optimizer``, priced by ``cost.table``).
Pure: reads the profile."""

from __future__ import annotations


def add_optimizer_step(profile, model: dict) -> None:
    profile.kernels["optimizer_step"] = dict(model)


def optimizer_step_s(profile, n_tensors: int, param_bytes: float) -> float | None:
    """Measured update time of ``n_tensors`` tensors of ``param_bytes`` in all, without the
    step's fixed share (``optimizer_fixed_s``); None when the profile has no measurement."""
    k = profile.kernels.get("optimizer_step") if isinstance(getattr(profile, "kernels", None), dict) else None
    if not k:
        return None
    return n_tensors * float(k["t0_s"]) + float(param_bytes) * float(k["s_per_byte"])


def optimizer_fixed_s(profile) -> float:
    """The optimizer step's fixed share, paid once per step whatever it updates (0 for a
    profile that measured none: those fitted the update hot and without it)."""
    k = profile.kernels.get("optimizer_step") if isinstance(getattr(profile, "kernels", None), dict) else None
    return float(k.get("fixed_s", 0.0)) if k else 0.0
