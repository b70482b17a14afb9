"""Train the shipped ResNet-style CNN (``resnet2d.py``) with a plan, in an ordinary torch loop.

Not a model file: a training script that uses ``autopar.parallelize`` the way one uses FSDP2.
A small classification data set is generated on the fly (each class is a bright square at its
own place in a noisy image), so the loss falls and the held-out accuracy rises within a few
epochs on 2 CPU cores::

    # a plan for 2 ranks (the shipped strategies/plans/resnet2d-w4 is for 4)
    autopar plan strategies/examples/resnet2d.py --world-size 2 -o /tmp/resnet2d-w2
    torchrun --standalone --nproc-per-node 2 strategies/examples/train_resnet2d.py \\
        --plan /tmp/resnet2d-w2/plan.json --epochs 3 --ckpt /tmp/resnet2d-ckpt
    # resume from the checkpoint, under another plan and world size
    torchrun --standalone --nproc-per-node 4 strategies/examples/train_resnet2d.py \\
        --plan strategies/plans/resnet2d-w4/plan.json --epochs 4 --ckpt /tmp/resnet2d-ckpt --resume

Each epoch: AdamW with a cosine schedule, gradients clipped by their global norm, then an
evaluation in eval mode (batch norm on running statistics) and a checkpoint (model,
optimizer, scheduler, epoch), written atomically.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autopar
from autopar import train

HERE = Path(__file__).resolve().parent


def load_model_module():
    spec = importlib.util.spec_from_file_location("resnet2d", HERE / "resnet2d.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Squares(torch.utils.data.Dataset):
    """``n`` images of ``image`` x ``image``: class c is a bright square at its own place (a
    ``classes``-cell grid), in Gaussian noise; generated from ``seed``, the same on every rank."""

    def __init__(self, n: int, classes: int, image: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, classes, (n,), generator=g)
        self.x = torch.randn(n, 3, image, image, generator=g)
        cells = int(classes ** 0.5 + 0.999)
        side = image // cells
        for i, c in enumerate(self.y.tolist()):
            r, q = divmod(c, cells)
            self.x[i, :, r * side:(r + 1) * side, q * side:(q + 1) * side] += 2.0

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=str(HERE.parent / "plans" / "resnet2d-w4" / "plan.json"))
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train-samples", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (saved every epoch)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    rank, world = train.init_distributed(args.plan)       # the plan's rank placement
    mod = load_model_module()
    torch.manual_seed(args.seed)
    model = mod.build_model()
    dmodel = autopar.parallelize(model, args.plan)          # this rank's shards
    del model

    data = Squares(args.train_samples, mod.NUM_CLASSES, mod.IMAGE, seed=1)
    held_out = Squares(args.eval_samples, mod.NUM_CLASSES, mod.IMAGE, seed=2)
    loader = autopar.plan_loader(data, dmodel, seed=args.seed)          # each rank: its blocks
    eval_loader = autopar.plan_loader(held_out, dmodel, shuffle=False)
    opt = torch.optim.AdamW(dmodel.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(loader))
    first_epoch = 0
    if args.resume:
        extra = autopar.load(args.ckpt, dmodel, opt)
        sched.load_state_dict(extra["scheduler"])
        first_epoch = extra["epoch"] + 1
    if rank == 0:
        print(json.dumps({"world": world, "plan": args.plan, "batch": dmodel.batch_size,
                          "loads": train.BatchSharding.of(dmodel).describe()}), flush=True)

    for epoch in range(first_epoch, args.epochs):
        dmodel.train()
        loader.batch_sampler.set_epoch(epoch)
        total, steps = 0.0, 0
        for inputs, target in loader:
            opt.zero_grad(set_to_none=True)
            loss = dmodel.loss(inputs, target)       # the global batch's mean loss on every rank
            loss.backward()
            norm = train.clip_grad_norm_(dmodel, args.max_norm)
            opt.step()
            sched.step()
            total += loss.item()
            steps += 1
        dmodel.eval()
        correct, seen, eval_loss = 0.0, 0, 0.0
        with torch.no_grad():
            for inputs, target in eval_loader:
                out = dmodel(*inputs)
                eval_loss += dmodel.reduce_loss(F.cross_entropy(out, target)).item()
                correct += dmodel.reduce_sum((out.argmax(1) == target).sum()).item()
                seen += dmodel.batch_size
        if args.ckpt:
            autopar.save(args.ckpt, dmodel, opt, extra={"scheduler": sched.state_dict(), "epoch": epoch})
        if rank == 0:
            print(json.dumps({"epoch": epoch, "train_loss": total / steps, "last_grad_norm": float(norm),
                              "eval_loss": eval_loss / len(eval_loader), "eval_accuracy": correct / seen}),
                  flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
