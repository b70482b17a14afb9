"""The user's own training loop on the untouched Hugging Face GPT-2 (``strategies/examples/hf_gpt2.py``,
whose ``loss_fn`` reads ``output.logits``) at world 4, through ``autopar.parallelize`` +
``autopar.plan_loader`` + ``dmodel.loss`` + ``autopar.clip_grad_norm_`` + AdamW, in float64:
under a data-parallel plan (run natively, the user's module on each rank's samples) and under a
head / MLP / vocabulary plan (the traced program, the loss vocabulary-parallel), every one of 4
steps' loss and gradient norm equals the single-process run within 1e-9 (relative), and the
clipping clips. Data: 16 sequences of token ids with [S] next-token targets (the language
model's [B, S] target), read through ``plan_loader`` with a seeded shuffle.

Issue 38: before the fix ``dmodel.loss`` handed the loss a bare tensor (``AttributeError:
'Tensor' object has no attribute 'logits'``) and ``plan_loader`` cut [B, S] targets as [B]
(``IndexError`` under the tensor-parallel plan).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

RTOL = 1e-9
N_DATA, BATCH, STEPS, SEED, WORLD = 16, 4, 4, 3, 4
MAX_NORM = 0.5
MODEL = Path(__file__).resolve().parents[1] / "strategies" / "examples" / "hf_gpt2.py"

# head / MLP / vocabulary: the tied table split by vocabulary in both its uses (the loss runs
# vocabulary-parallel), heads and MLPs split, all on a 2 x 2 (sample x tensor) mesh
TP_FORCE = {"transformer.wte": "vocab(2,2)", "lm_head": "vocab_head(2,2)",
            "transformer.h.0.attn": "head(2,2)", "transformer.h.1.attn": "head(1,4)",
            "transformer.h.0.mlp": "mlp(2,2)", "transformer.h.1.mlp": "mlp(1,4)"}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    from fakes import synthetic_profile

    from autopar.artifacts import PlanHooks, PlanOptions
    from autopar.modelfile import load_model_file
    from autopar.planner import attention_units, make_plan
    from autopar.trace.tracer import trace_model

    base = tmp_path_factory.mktemp("gpt2loop")
    g = attention_units(trace_model(load_model_file(MODEL), BATCH))

    def unit(module):
        return max((lay for lay in g.layers if lay.module == module), key=lambda lay: len(lay.ops)).index

    out = {}
    for name, kinds, force in (("dp", ["sample"], {}),
                               ("tp", None, {unit(m): c for m, c in TP_FORCE.items()})):
        r = make_plan(MODEL, PlanOptions(world_size=WORLD, batch_size=BATCH, out_dir=str(base / name), kinds=kinds,
                                         max_candidates=30),
                      PlanHooks(profile=synthetic_profile(), force=force))
        out[name] = r.plan_path
        choices = {g.layers[d.layer].module: d.choice for d in r.plan.layers}
        if name == "dp":
            assert {c for c in choices.values()} <= {"sample(4)", "replicate"}
        else:
            for m, c in TP_FORCE.items():
                assert r.plan.layer(unit(m)).choice == c, (m, r.plan.layer(unit(m)).choice)
    return out


def _data():
    import torch
    g = torch.Generator().manual_seed(11)
    from autopar.modelfile import load_model_file
    mf = load_model_file(MODEL)
    vocab, seq = mf.module.VOCAB, mf.module.SEQ
    ids = torch.randint(0, vocab, (N_DATA, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()     # next-token targets [N, S]


class _DS:
    def __init__(self):
        self.x, self.y = _data()

    def __len__(self):
        return N_DATA

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _model():
    import torch

    from autopar.modelfile import load_model_file
    torch.manual_seed(0)
    return load_model_file(MODEL).build_model().double()


def _optimizer(params):
    import torch
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _reference(rank, world):
    import torch

    from autopar.modelfile import load_model_file
    loss_fn = load_model_file(MODEL).loss_fn()
    model = _model()
    opt = _optimizer(model.parameters())
    x, y = _data()
    perm = torch.randperm(N_DATA, generator=torch.Generator().manual_seed(SEED))
    losses, norms = [], []
    for k in range(STEPS):
        idx = perm[k * BATCH:(k + 1) * BATCH]
        opt.zero_grad()
        loss = loss_fn(model(x[idx]), y[idx])
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        losses.append(float(loss))
    return {"losses": losses, "norms": norms}


def _user_loop(rank, world, plan):
    import autopar
    dm = autopar.parallelize(_model(), plan)
    opt = _optimizer(dm.parameters())
    losses, norms = [], []
    for inputs, target in autopar.plan_loader(_DS(), dm, seed=SEED):
        opt.zero_grad()
        loss = dm.loss(inputs, target)           # the model file's loss_fn reads output.logits
        loss.backward()
        norms.append(float(autopar.clip_grad_norm_(dm, MAX_NORM)))
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "native": dm.native}


@pytest.fixture(scope="module")
def reference():
    from autopar.runtime.launch import run_ranks
    return run_ranks(_reference, 1, timeout_s=180)[0]


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dp", "tp"])
def test_user_loop_on_hf_gpt2_equals_one_process(name, plans, reference):
    from autopar.runtime.launch import run_ranks
    got = run_ranks(_user_loop, WORLD, args=(str(plans[name]),), timeout_s=300)
    assert got[0]["native"] == (name == "dp")      # the two runtimes, each exercised
    for r in got:
        assert len(r["losses"]) == STEPS
        assert _rel(r["losses"], reference["losses"]) <= RTOL, (r["losses"], reference["losses"])
        assert _rel(r["norms"], reference["norms"]) <= RTOL, (r["norms"], reference["norms"])
    assert min(reference["norms"]) > MAX_NORM, "clipping never clipped: the test tests nothing"
