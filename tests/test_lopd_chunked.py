"""LOPDModule(distill_chunk_size=c): the LM head applied c rows at a time gives the unchunked step.

The chunked path keeps only final hidden states (N, d) of the student and the teacher and computes the
distillation KL of both losses and the margin's token log-probs chunk by chunk (the LM head recomputed
in backward). These tests check, on the tiny model and the toy task (CPU, seeded), that one training
step logs the same losses and produces the same gradients (student LoRA or every backbone weight with
the LM head, composer LoRA, resampler) as ``distill_chunk_size=None``, with a chunk that does not
divide N; and the building blocks (lm.py, lm_head.py, teacher/) against their unchunked references.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lopd_lightning.adapters import adapter_parameters, base_parameters, prepare_backbone
from lopd_lightning.lm import lm_head_logits, selected_hidden_states, selected_logits, unpack
from lopd_lightning.losses.lm_head import (
    LMHead,
    chunked_head_kl,
    chunked_token_logps,
    constant_head,
    distillation_loss,
    lm_head_parameters,
)
from lopd_lightning.composer.objective import margin_delta, privileged_margin
from lopd_lightning.losses import token_logps, topk_tail_reverse_kl
from lopd_lightning.memory.bank import ExperienceBank
from lopd_lightning.memory.embed import get_embedder
from lopd_lightning.models import tiny_model, tiny_tokenizer
from lopd_lightning.tasks.toy import ToyTask
from lopd_lightning.teacher import SelfTeacher

from test_lopd_module import LORA, EvenToy, Recorder, make_dm, make_module, make_trainer, reference_experiences

LOGGED = ["train/loss", "train/composer_loss", "train/margin_delta", "train/composer_anchor"]


@pytest.fixture(scope="module")
def bank_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bank_chunked")
    bank = ExperienceBank(get_embedder("hashing"))
    bank.add(reference_experiences(ToyTask()))
    bank.save(folder)
    return folder


# ------------------------------------------------------------------------------ one training step
def grad_groups(module) -> dict[str, list[torch.nn.Parameter]]:
    groups = {
        "composer_lora": module.composer.lora_parameters(),
        "resampler": module.composer.compressor_parameters(),
    }
    if module.is_lora_student:
        groups["student_lora"] = adapter_parameters(module.backbone, "student")
    else:
        groups["backbone"] = base_parameters(module.backbone)
        groups["lm_head"] = [module.backbone.get_base_model().get_output_embeddings().weight]
    return groups


def one_step(tmp_path: Path, bank_dir: Path, chunk: int | None, **overrides) -> dict:
    """One seeded training step; the logged scalars, the batch and every gradient right after backward."""
    torch.manual_seed(0)
    module = make_module(bank_dir, distill_chunk_size=chunk, margin=1.0, beta_init=0.7, **overrides)
    groups = grad_groups(module)
    grads: dict[str, list] = {}
    original = module.manual_backward

    def manual_backward(loss, *args, **kwargs):
        original(loss, *args, **kwargs)
        for name, params in groups.items():
            grads[name] = [None if p.grad is None else p.grad.detach().clone() for p in params]

    module.manual_backward = manual_backward
    rec = Recorder()
    make_trainer(tmp_path / str(chunk), max_steps=1, callbacks=[rec]).fit(module, make_dm(EvenToy(), examples_per_step=2))
    step = rec.steps[0]
    return {"logged": step["logged"], "batch": step["batch"], "grads": grads}


def assert_same_step(ref: dict, got: dict, *, rtol: float = 1e-5, atol: float = 1e-7, loss_atol: float = 1e-6) -> None:
    """Two :func:`one_step` results: the same logged losses (rel 1e-5, or ``loss_atol`` absolute) and,
    parameter by parameter, the same gradients (``rtol`` / ``atol``); every group of the reference has a
    non-zero gradient, so the comparison cannot pass vacuously.

    ``loss_atol``: the student's distillation KL of a barely trained toy step is about 2e-5, a sum of
    terms p (log p - log q) whose float32 rounding is about 1e-7 each; two exact evaluations (whole
    logits against chunks, on different matmul shapes) differ by about that much (1.1e-7 seen on an
    AVX2 CPU), so 1e-6 absolute is the float32 resolution of that number, not slack."""
    for tag in LOGGED:
        assert got["logged"][tag] == pytest.approx(ref["logged"][tag], rel=1e-5, abs=loss_atol), tag
    assert set(got["grads"]) == set(ref["grads"])
    for name, ref_grads in ref["grads"].items():
        assert any(g is not None and g.abs().sum() > 0 for g in ref_grads), f"{name}: no gradient"
        for i, (a, b) in enumerate(zip(ref_grads, got["grads"][name], strict=True)):
            assert (a is None) == (b is None), f"{name}[{i}]"
            if a is not None:
                torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=f"{name}[{i}]")


def non_dividing_chunk(n: int) -> int:
    """The smallest chunk >= 3 that leaves a short last chunk and makes at least two chunks."""
    for c in range(3, n):
        if n % c:
            return c
    raise AssertionError(f"no chunk size fits N={n}")


@pytest.mark.parametrize("student", ["lora", "full"])
def test_chunked_step_equals_unchunked_step(tmp_path, bank_dir, student):
    options = dict(lora=LORA if student == "lora" else None)
    ref = one_step(tmp_path, bank_dir, None, **options)
    n = int(ref["batch"].assistant_mask[:, 1:].sum())
    chunk = non_dividing_chunk(n)
    assert n > chunk and n % chunk != 0
    got = one_step(tmp_path, bank_dir, chunk, **options)

    # the same rollouts
    assert torch.equal(ref["batch"].input_ids, got["batch"].input_ids)
    assert torch.equal(ref["batch"].rewards, got["batch"].rewards)
    # the same logged losses and gradients; the margin term is live (beta > 0, latents present)
    assert ref["logged"]["train/margin_delta"] != 0.0 and ref["logged"]["train/loss"] > 0
    assert_same_step(ref, got)


def test_chunked_step_with_a_frozen_teacher_copy(tmp_path, bank_dir):
    """Full student, teacher_mode="base": the teacher's LM head is its frozen copy's, apart from the student's."""
    options = dict(lora=None, teacher_mode="base")
    ref = one_step(tmp_path, bank_dir, None, **options)
    n = int(ref["batch"].assistant_mask[:, 1:].sum())
    got = one_step(tmp_path, bank_dir, non_dividing_chunk(n), **options)
    assert_same_step(ref, got)


@pytest.mark.parametrize("bad", [0, -2, 1.5, 3.0, True])
def test_bad_chunk_size_fails_before_loading_the_model(no_model_loading, bad):
    with pytest.raises(ValueError, match="model.init_args.distill_chunk_size must be null or an int >= 1"):
        make_module(None, distill_chunk_size=bad)


# ----------------------------------------------------------------------------------- building blocks
def test_selected_hidden_states_through_the_head_equal_selected_logits():
    model = tiny_model(seed=1)
    ids = torch.randint(3, 259, (3, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = torch.rand(3, 11, generator=torch.Generator().manual_seed(1)) > 0.5
    hidden = selected_hidden_states(model, positions, input_ids=ids, attention_mask=mask)
    assert hidden.shape == (int(positions.sum()), 64)
    expected = selected_logits(model, positions, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(lm_head_logits(model, hidden), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(F.linear(hidden, *lm_head_parameters(model)), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="positions has shape"):
        selected_hidden_states(model, positions[:, :-1], input_ids=ids, attention_mask=mask)


def test_teacher_hidden_through_its_head_equal_its_packed_logits():
    torch.manual_seed(0)
    backbone = prepare_backbone(tiny_model(seed=2), student_lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    teacher = SelfTeacher(backbone, tiny_tokenizer(), mode="live")
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    latents = torch.randn(2, 4, 64, requires_grad=True)
    positions = torch.zeros(2, 9, dtype=torch.bool)
    positions[0, 4:8] = True
    positions[1, 3:6] = True
    kwargs = dict(latents=latents, latent_mask=torch.ones(2, 4, dtype=torch.bool), positions=positions)
    logits = teacher.logits_on_student_positions(ids, attn, torch.tensor([2, 1]), **kwargs)
    hidden = teacher.hidden_on_student_positions(ids, attn, torch.tensor([2, 1]), **kwargs)
    torch.testing.assert_close(F.linear(hidden, *teacher.head_parameters()), logits, atol=1e-5, rtol=1e-5)
    hidden.sum().backward()
    assert latents.grad is not None and latents.grad.abs().sum() > 0
    assert all(p.grad is None for p in backbone.parameters())  # the backbone is constant


def test_a_lora_on_the_lm_head_is_refused():
    backbone = prepare_backbone(tiny_model(seed=2), student_lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ValueError, match="not an nn.Linear"):
        lm_head_parameters(backbone)


def _head_case(seed: int = 0, n: int = 7, d: int = 5, v: int = 13, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    ws = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    wt = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    bs = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    bt = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if bias else None
    return hs, ht, ws, bs, wt, bt


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None and t.requires_grad], allow_unused=True)


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
def test_chunked_head_kl_two_heads_equal_the_dense_kl(chunk):
    hs, ht, ws, bs, wt, bt = _head_case()
    upstream = torch.linspace(0.5, 2.0, hs.shape[0], dtype=torch.float64)
    dense = topk_tail_reverse_kl(F.linear(hs, ws, bs), F.linear(ht, wt, bt), top_k=4, temperature=0.7)
    got = chunked_head_kl(hs, ht, (ws, bs), (wt, bt), top_k=4, temperature=0.7, chunk_size=chunk)
    torch.testing.assert_close(got, dense)
    leaves = (hs, ht, ws, bs, wt, bt)
    for a, b in zip(_grads((got * upstream).sum(), leaves), _grads((dense * upstream).sum(), leaves), strict=True):
        torch.testing.assert_close(a, b)


def test_chunked_head_kl_reaches_only_the_heads_that_need_grad():
    """The student's call of a full student: the teacher side (hidden and head) constant, one shared weight."""
    hs, ht, ws, bs, _, _ = _head_case()
    student_head = (ws, bs)
    teacher_head = constant_head(student_head)
    assert teacher_head[0] is not ws and not teacher_head[0].requires_grad
    got = chunked_head_kl(hs, ht.detach(), student_head, teacher_head, top_k=3, chunk_size=2)
    dense = topk_tail_reverse_kl(F.linear(hs, ws, bs), F.linear(ht, ws, bs).detach(), top_k=3)
    torch.testing.assert_close(got, dense)
    for a, b in zip(_grads(got.sum(), (hs, ws, bs)), _grads(dense.sum(), (hs, ws, bs)), strict=True):
        torch.testing.assert_close(a, b)
    # a constant head is passed through untouched
    frozen = (ws.detach(), None)
    assert constant_head(frozen)[0] is frozen[0]
    # the same tensors on both sides: the library's chunked loss, gradient to the teacher's hidden states
    got_c = chunked_head_kl(hs.detach(), ht, teacher_head, teacher_head, top_k=3, chunk_size=2)
    dense_c = topk_tail_reverse_kl(F.linear(hs, ws, bs).detach(), F.linear(ht, *teacher_head), top_k=3)
    torch.testing.assert_close(got_c, dense_c)
    torch.testing.assert_close(_grads(got_c.sum(), (ht,))[0], _grads(dense_c.sum(), (ht,))[0])


@pytest.mark.parametrize("chunk", [1, 4, 50])
def test_chunked_token_logps_equal_token_logps(chunk):
    hs, _, ws, bs, _, _ = _head_case(seed=1, n=9)
    tokens = torch.randint(0, 13, (9,), generator=torch.Generator().manual_seed(2))
    dense = token_logps(F.linear(hs, ws, bs)[None], tokens[None], temperature=1.3)[0]
    got = chunked_token_logps(hs, tokens, (ws, bs), temperature=1.3, chunk_size=chunk)
    torch.testing.assert_close(got, dense)
    upstream = torch.linspace(-1.0, 1.0, 9, dtype=torch.float64)
    for a, b in zip(_grads((got * upstream).sum(), (hs, ws, bs)), _grads((dense * upstream).sum(), (hs, ws, bs)), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_logps(hs, tokens, (ws, bs), temperature=1.3, chunk_size=chunk), dense.detach())


def test_empty_rows_give_empty_results():
    hs, ht, ws, bs, wt, bt = _head_case(n=0)
    assert chunked_head_kl(hs, ht, (ws, bs), (wt, bt), top_k=3, chunk_size=2).shape == (0,)
    assert chunked_token_logps(hs, torch.zeros(0, dtype=torch.long), (ws, bs), chunk_size=2).shape == (0,)


# ------------------------------------------------------------------------------------ the LMHead object
class _HeadModel(torch.nn.Module):
    """The smallest model :func:`lm_head_parameters` reads: an output head and a config without soft-capping."""

    def __init__(self, v: int, d: int, dtype: torch.dtype, seed: int, *, bias: bool = True, trainable: bool = True):
        super().__init__()
        import types

        self.config = types.SimpleNamespace(final_logit_softcapping=None)
        self.lm_head = torch.nn.Linear(d, v, bias=bias, dtype=dtype)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.lm_head.weight.copy_(0.7 * torch.randn(v, d, generator=g, dtype=dtype))
            if bias:
                self.lm_head.bias.copy_(torch.randn(v, generator=g, dtype=dtype))
        self.requires_grad_(trainable)

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head


def _naive_topk_tail_kl(ls: torch.Tensor, lt: torch.Tensor, k: int, tau: float) -> torch.Tensor:
    """KL(p~_S || p~_T) straight from docs/METHOD.md 5: softmaxes, the teacher's top-k, a tail of 1 - sum."""
    ps, pt = torch.softmax(ls / tau, dim=-1), torch.softmax(lt / tau, dim=-1)
    index = pt.detach().topk(k, dim=-1).indices
    s_top, t_top = ps.gather(-1, index), pt.gather(-1, index)
    s_tail, t_tail = 1 - s_top.sum(-1), 1 - t_top.sum(-1)
    return (s_top * (s_top.log() - t_top.log())).sum(-1) + s_tail * (s_tail.log() - t_tail.log())


def _naive_token_logps(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return (logits.exp() / logits.exp().sum(-1, keepdim=True)).log().gather(-1, tokens[:, None])[:, 0]


TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.float64: dict(rtol=1e-10, atol=1e-12)}


def _three_ways(dtype: torch.dtype, shared: bool, student_trains: bool, chunk: int, weighting: str = "paper",
                rows: torch.Tensor | None = None):
    """The student's and the composer's losses of one toy batch, in full mode, in chunked mode and from the
    naive float64 reference; each with the gradients of its leaves (hidden states and head weights)."""
    n, d, v, k, tau = 11, 6, 29, 4, 0.8
    g = torch.Generator().manual_seed(7)
    hidden_s = torch.randn(n, d, generator=g).to(dtype)
    hidden_t = torch.randn(n, d, generator=g).to(dtype)
    tokens = torch.randint(0, v, (n,), generator=g)
    positions = torch.zeros(3, 6, dtype=torch.bool)
    positions.view(-1)[torch.randperm(18, generator=g)[:n]] = True
    rewards = torch.tensor([1.0, 0.0, 1.0], dtype=dtype)
    rows = torch.tensor([True, True, False]) if rows is None else rows
    student_model = _HeadModel(v, d, dtype, seed=1, trainable=student_trains)
    teacher_model = student_model if shared else _HeadModel(v, d, dtype, seed=2, trainable=False)
    results = {}
    for mode in ("full", "chunked", "naive"):
        hs, ht = hidden_s.clone().requires_grad_(True), hidden_t.clone().requires_grad_(True)
        ws, bs = student_model.lm_head.weight, student_model.lm_head.bias
        wt, bt = teacher_model.lm_head.weight, teacher_model.lm_head.bias
        if mode == "chunked":
            head, s_in, t_in = LMHead(student_model, teacher_model, chunk_size=chunk), hs, ht
        else:  # logits as the forwards would return them: the teacher's head is a constant of its pass
            cast = (lambda x: x.double()) if mode == "naive" else (lambda x: x)
            s_in = F.linear(cast(hs), cast(ws), cast(bs))
            t_in = F.linear(cast(ht), cast(wt).detach(), cast(bt).detach())
            head = LMHead()
        if mode == "naive":
            loss_s = _naive_topk_tail_kl(s_in, t_in.detach(), k, tau).sum() / 20.0
            loss_c = _naive_topk_tail_kl(s_in.detach(), t_in, k, tau).sum() / 20.0
            delta = privileged_margin(unpack(_naive_token_logps(t_in, tokens), positions),
                                      unpack(_naive_token_logps(s_in.detach(), tokens), positions),
                                      rewards.double(), positions & rows[:, None], weighting=weighting)
        else:
            loss_s = distillation_loss(head, s_in, t_in.detach(), top_k=k, temperature=tau, num_tokens=20.0)
            loss_c = distillation_loss(head, s_in.detach(), t_in, top_k=k, temperature=tau, num_tokens=20.0)
            delta = margin_delta(head, s_in, t_in, tokens, positions, rewards, rows=rows, weighting=weighting)
        leaves = [hs, ht] + [p for p in (ws, bs) if p.requires_grad]
        student_grads = torch.autograd.grad(loss_s, leaves, allow_unused=True, retain_graph=True)
        composer_grads = torch.autograd.grad(loss_c + 0.3 * delta, leaves, allow_unused=True)
        results[mode] = dict(values=(loss_s, loss_c, delta), student=student_grads, composer=composer_grads)
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shared, student_trains", [(True, False), (True, True), (False, True)],
                         ids=["lora_live", "full_live", "full_frozen_copy"])
@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_lm_head_full_and_chunked_give_the_naive_losses_and_gradients(dtype, shared, student_trains, chunk):
    """The student's loss trains the student's hidden states and (full student) its head, never the
    teacher's; the composer's loss and the margin train only the teacher's hidden states (the latents' path)."""
    got = _three_ways(dtype, shared, student_trains, chunk)
    tol = TOLERANCE[dtype]
    for mode in ("full", "chunked"):
        for a, b in zip(got[mode]["values"], got["naive"]["values"], strict=True):
            torch.testing.assert_close(a.double(), b.double(), **tol)
        for kind in ("student", "composer"):
            for i, (a, b) in enumerate(zip(got[mode][kind], got["naive"][kind], strict=True)):
                assert (a is None) == (b is None), (mode, kind, i)
                if a is not None:
                    torch.testing.assert_close(a.double(), b.double(), **tol, msg=f"{mode} {kind} grad {i}")
    hs_grad, ht_grad, *head_grads = got["chunked"]["student"]
    assert hs_grad.abs().sum() > 0 and ht_grad is None  # the teacher is a constant of the student's loss
    assert all(g is not None and g.abs().sum() > 0 for g in head_grads) and len(head_grads) == (2 if student_trains else 0)
    hs_grad, ht_grad, *head_grads = got["chunked"]["composer"]
    assert hs_grad is None and ht_grad.abs().sum() > 0 and all(g is None for g in head_grads)


@pytest.mark.parametrize("chunk", [1, 4])
def test_margin_delta_balanced_weighting_equals_the_naive_reference(chunk):
    every_row = torch.tensor([True, True, True])  # two successes and one failure count
    got = _three_ways(torch.float64, True, False, chunk, weighting="balanced", rows=every_row)
    paper = _three_ways(torch.float64, True, False, chunk, rows=every_row)
    for mode in ("full", "chunked"):
        torch.testing.assert_close(got[mode]["values"][2], got["naive"]["values"][2], **TOLERANCE[torch.float64])
        for a, b in zip(got[mode]["composer"], got["naive"]["composer"], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(a, b, **TOLERANCE[torch.float64])
    # 2 successes, 1 failure: paper = (D0 + D2 + D1) / 3, balanced = (D0 + D2) / 4 + D1 / 2, so
    # they differ unless D1 = (D0 + D2) / 2 (checked: the weighting reaches margin_delta)
    assert abs(got["naive"]["values"][2].item() - paper["naive"]["values"][2].item()) > 1e-3


def test_lm_head_modes_and_errors():
    model = _HeadModel(9, 4, torch.float32, seed=0)
    assert LMHead().output == "logits" and not LMHead().chunked
    head = LMHead(model, model, chunk_size=3)
    assert head.output == "hidden" and head.chunked and head.chunk_size == 3
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size must be None or an int >= 1"):
            LMHead(model, model, chunk_size=bad)
    with pytest.raises(ValueError, match="needs the student's and the teacher's models"):
        LMHead(model, None, chunk_size=2)
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(4, 9))  # not a plain linear head: refused at construction
    with pytest.raises(ValueError, match="not an nn.Linear"):
        LMHead(model, model, chunk_size=2)
    with pytest.raises(ValueError, match="side must be 'student' or 'teacher'"):
        LMHead().token_logps(torch.zeros(2, 9), torch.zeros(2, dtype=torch.long), side="both")  # type: ignore[arg-type]


def test_lm_head_reads_the_heads_at_every_call():
    """After the weights are replaced (``.to()``, a strategy's wrapping) the chunked head uses the new ones."""
    model = _HeadModel(9, 4, torch.float64, seed=0, trainable=False)
    head = LMHead(model, model, chunk_size=2)
    hidden = torch.randn(5, 4, dtype=torch.float64)
    tokens = torch.randint(0, 9, (5,))
    model.lm_head.weight.data = model.lm_head.weight.data * 2  # as Module.to() swaps a parameter's data
    want = token_logps(F.linear(hidden, model.lm_head.weight, model.lm_head.bias)[None], tokens[None])[0]
    torch.testing.assert_close(head.token_logps(hidden, tokens, side="student"), want)
