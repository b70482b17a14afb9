"""Does a convolution take as long inside a training step as calibration times it alone?

For each model file and local batch (``WORKLOADS``: the prediction benchmark's in-sample CNNs at
the local batches of their plans, and one held-out CNN), one process, one thread, in rounds:

1. **in the step**: the model's own training step (``bench_step_parts._step_fn``: the user's
   module, SGD with momentum, ``autopar execute``'s synthetic batch), 20 steps, with every
   convolution module's forward timed by module hooks and its backward node
   (``ConvolutionBackward0``: data and filter gradient together) by the node's pre- and
   post-hooks; the median per convolution over the steps;
2. **as calibration times it**: the same convolutions' exact shapes measured by
   ``calibrate.kernels.measure_exact`` (each phase back to back, its results kept in a ring as a
   step keeps its activations), the phases a step runs summed (no data gradient where the
   convolution's input needs none);
3. the step without hooks, 20 steps, median (what the hooks add is the difference to the
   hooked step, printed).

Per round the ratio in the step / as calibrated of the forward sums and of the backward sums;
the median over rounds is printed with the range. Nothing here is a prediction: it says how
much of a plan's compute the exact-shape prices leave out, and for which models.

    python benchmarks/bench_step_context.py [--rounds 6] [--steps 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_step_parts import EX, MODELS, _step_fn  # noqa: E402

#: (label, model file, local batch): ResNet-2D at the local batches of its world-4, world-2
#: and replicated world-2 plans, the wide ResNet and the 3-D CNN at their world-2 ones, and
#: the held-out VGG at its world-2 one
WORKLOADS = [("resnet2d", EX / "resnet2d.py", 4), ("resnet2d", EX / "resnet2d.py", 8),
             ("resnet2d", EX / "resnet2d.py", 16), ("wide_resnet", EX / "wide_resnet.py", 4),
             ("cnn3d_large", EX / "cnn3d_large.py", 2), ("heldout_vgg", MODELS / "heldout_vgg.py", 8)]


def _conv_spec(mod, x) -> dict:
    """The exact-shape spec (``calibrate.kernels.shape_key``'s input) of ``mod`` applied to ``x``,
    as ``ops.conv``'s ``shape_spec`` writes it for a traced convolution (``padding="same"`` stays
    a string)."""
    pad = mod.padding if isinstance(mod.padding, str) else list(mod.padding)
    return {"op": "conv", "x": list(x.shape), "w": list(mod.weight.shape), "stride": list(mod.stride),
            "padding": pad, "dilation": list(mod.dilation), "groups": int(mod.groups)}


class ConvTimer:
    """Forward and backward seconds of each convolution module of ``model`` in the steps run
    while ``on`` (module hooks around forward; pre- and post-hooks on its backward node)."""

    def __init__(self, model) -> None:
        import torch
        self.convs = [m for m in model.modules() if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d,
                                                                 torch.nn.Conv3d))]
        self.on = False
        self.fwd: dict[int, list[float]] = {i: [] for i in range(len(self.convs))}
        self.bwd: dict[int, list[float]] = {i: [] for i in range(len(self.convs))}
        self.specs: dict[int, dict] = {}
        self.data_grad: dict[int, bool] = {}
        self._t0: dict[int, float] = {}
        for i, m in enumerate(self.convs):
            m.register_forward_pre_hook(self._pre(i))
            m.register_forward_hook(self._post(i))

    def _pre(self, i):
        def hook(mod, inp):
            if i not in self.specs:
                self.specs[i] = _conv_spec(mod, inp[0])
                self.data_grad[i] = bool(inp[0].requires_grad)
            if self.on:
                self._t0[i] = time.perf_counter()
        return hook

    def _post(self, i):
        def hook(mod, inp, out):
            if not self.on:
                return
            self.fwd[i].append(time.perf_counter() - self._t0[i])
            node = out.grad_fn
            if node is None:
                return
            box: list[float] = []
            node.register_prehook(lambda grad_out: box.append(time.perf_counter()))
            node.register_hook(lambda grad_in, grad_out: self.bwd[i].append(time.perf_counter() - box[-1]))
        return hook

    def clear(self) -> None:
        for d in (self.fwd, self.bwd):
            for v in d.values():
                v.clear()

    def sums_s(self) -> tuple[float, float]:
        return (sum(statistics.median(v) for v in self.fwd.values() if v),
                sum(statistics.median(v) for v in self.bwd.values() if v))


def _calibrated_sums_s(timer: ConvTimer) -> tuple[float, float]:
    """(forward, backward) sums of the convolutions as ``measure_exact`` times them."""
    from autopar.calibrate.kernels import measure_exact, shape_key
    exact = measure_exact(list(timer.specs.values()), "cpu", repeats=10)
    f = b = 0.0
    for i, spec in timer.specs.items():
        e = exact[shape_key(spec)]
        f += e["fwd"]
        b += e["bwd_filter"] + (e["bwd_data"] if timer.data_grad[i] else 0.0)
    return f, b


def measure(path: Path, batch: int, rounds: int, steps: int) -> dict:
    import torch

    from autopar.calibrate.overhead import _median_s as timed     # one untimed call, then the median
    torch.set_num_threads(1)
    step, model = _step_fn(str(path), batch)
    timer = ConvTimer(model)
    for _ in range(3):
        step()
    out: dict = {"fwd_ratio": [], "bwd_ratio": [], "step_s": [], "hooked_step_s": [], "fwd_in_step_s": [],
                 "bwd_in_step_s": [], "fwd_calibrated_s": [], "bwd_calibrated_s": []}
    for _ in range(rounds):
        timer.clear()
        timer.on = True
        hooked = timed(step, steps)
        timer.on = False
        fi, bi = timer.sums_s()
        fc, bc = _calibrated_sums_s(timer)
        plain = timed(step, steps)
        for k, v in (("fwd_ratio", fi / fc), ("bwd_ratio", bi / bc), ("step_s", plain), ("hooked_step_s", hooked),
                     ("fwd_in_step_s", fi), ("bwd_in_step_s", bi), ("fwd_calibrated_s", fc), ("bwd_calibrated_s", bc)):
            out[k].append(v)
    out["convs"] = len(timer.convs)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", help="also write the printout here")
    args = ap.parse_args(argv)
    lines: list[str] = []

    def say(s: str) -> None:
        print(s, flush=True)
        lines.append(s)

    say(f"convolutions in the step against as calibrated ({args.rounds} rounds of {args.steps} steps; "
        "ratio = in the step / as calibrated per round, median (range) over rounds; one process, one thread)")
    med = statistics.median
    for label, path, batch in WORKLOADS:
        r = measure(path, batch, args.rounds, args.steps)
        gap = med(a - b for a, b in zip(r["fwd_in_step_s"], r["fwd_calibrated_s"])) + \
            med(a - b for a, b in zip(r["bwd_in_step_s"], r["bwd_calibrated_s"]))
        say(f"  {label:<12} batch {batch:>2} ({r['convs']} convs): step {1e3 * med(r['step_s']):7.2f} ms "
            f"(hooked {1e3 * med(r['hooked_step_s']):7.2f}) | forward {1e3 * med(r['fwd_in_step_s']):7.2f} ms "
            f"in the step, {1e3 * med(r['fwd_calibrated_s']):7.2f} as calibrated, x{med(r['fwd_ratio']):.2f} "
            f"({min(r['fwd_ratio']):.2f}-{max(r['fwd_ratio']):.2f}) | backward {1e3 * med(r['bwd_in_step_s']):7.2f} "
            f"/ {1e3 * med(r['bwd_calibrated_s']):7.2f} ms, x{med(r['bwd_ratio']):.2f} "
            f"({min(r['bwd_ratio']):.2f}-{max(r['bwd_ratio']):.2f}) | in-step excess {1e3 * gap:+.2f} ms, "
            f"{100 * gap / med(r['step_s']):+.1f} % of the step")
    if args.out:
        from autopar.io import atomic_write_text
        atomic_write_text(Path(args.out), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
