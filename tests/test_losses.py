"""Tests for lopd_lightning.losses: hand-derived values, naive references, edge cases, properties.

Naive references are written here from the definitions (explicit exp / sum, no log_softmax) and run in
float64; each function is compared against them in float32 and float64, and bfloat16 inputs against the
reference of the bf16-rounded values.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lopd_lightning.composer.objective import anchor_loss, composer_objective, has_both_outcomes, privileged_margin
from lopd_lightning.losses import (
    generalized_jsd,
    k3_kl,
    masked_mean,
    ppo_clip_fraction,
    ppo_clip_loss,
    token_logps,
    topk_tail_logprobs,
    topk_tail_reverse_kl,
)

LN = math.log
TEMPERATURES = [0.5, 1.0, 2.0]


# --------------------------------------------------------------------------------------------------
# naive references (float64, straight from the definitions)
# --------------------------------------------------------------------------------------------------
def naive_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    x = logits.double() / temperature
    e = torch.exp(x - x.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


def naive_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum p log(p / q) with 0 log 0 = 0."""
    terms = torch.where(p > 0, p * torch.log(p / q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def naive_jsd(student_logits, teacher_logits, beta, temperature=1.0):
    s, t = naive_probs(student_logits, temperature), naive_probs(teacher_logits, temperature)
    if beta == 0:
        return naive_kl(t, s)
    if beta == 1:
        return naive_kl(s, t)
    m = beta * t + (1 - beta) * s
    return beta * naive_kl(t, m) + (1 - beta) * naive_kl(s, m)


def naive_bucketed_reverse_kl(student_logits, teacher_logits, k, temperature=1.0, support="teacher"):
    s, t = naive_probs(student_logits, temperature), naive_probs(teacher_logits, temperature)
    idx = (t if support == "teacher" else s).topk(k, dim=-1).indices
    s_top, t_top = s.gather(-1, idx), t.gather(-1, idx)
    s_b = torch.cat([s_top, 1 - s_top.sum(-1, keepdim=True)], dim=-1)
    t_b = torch.cat([t_top, 1 - t_top.sum(-1, keepdim=True)], dim=-1)
    return naive_kl(s_b, t_b)


def random_logits(*shape, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def divergences(student, teacher, temperature=1.0):
    """Every divergence of the module at one temperature, by name."""
    v = student.shape[-1]
    return {
        "topk_tail_k2": topk_tail_reverse_kl(student, teacher, top_k=2, temperature=temperature),
        "topk_tail_full": topk_tail_reverse_kl(student, teacher, top_k=v, temperature=temperature),
        "jsd_0": generalized_jsd(student, teacher, beta=0.0, temperature=temperature),
        "jsd_0.3": generalized_jsd(student, teacher, beta=0.3, temperature=temperature),
        "jsd_0.5": generalized_jsd(student, teacher, beta=0.5, temperature=temperature),
        "jsd_1": generalized_jsd(student, teacher, beta=1.0, temperature=temperature),
    }


# --------------------------------------------------------------------------------------------------
# token_logps
# --------------------------------------------------------------------------------------------------
class TestTokenLogps:
    def test_hand_value(self):
        # logits ln[1, 2, 1] -> p = [1/4, 1/2, 1/4]; token 1 -> ln(1/2), token 0 -> ln(1/4).
        logits = torch.log(torch.tensor([[[1.0, 2.0, 1.0], [1.0, 2.0, 1.0]]]))  # [1, 2, 3]
        tokens = torch.tensor([[1, 0]])
        out = token_logps(logits, tokens)
        assert out.dtype == torch.float32 and out.shape == (1, 2)
        torch.testing.assert_close(out, torch.tensor([[LN(0.5), LN(0.25)]]))

    def test_hand_value_temperature(self):
        # tau = 2: logits / 2 = [0, ln(2)/2, 0] -> p proportional to [1, sqrt 2, 1];
        # token 1 -> ln(sqrt 2 / (2 + sqrt 2)) = ln(0.414214) = -0.881374.
        logits = torch.log(torch.tensor([[[1.0, 2.0, 1.0]]]))
        out = token_logps(logits, torch.tensor([[1]]), temperature=2.0)
        expected = LN(math.sqrt(2) / (2 + math.sqrt(2)))
        assert expected == pytest.approx(-0.881374, abs=1e-6)
        torch.testing.assert_close(out, torch.tensor([[expected]]))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("temperature", TEMPERATURES)
    def test_matches_naive(self, dtype, temperature):
        logits = random_logits(3, 5, 11, seed=1, scale=3.0, dtype=dtype)
        tokens = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(2))
        ref = torch.log(naive_probs(logits, temperature)).gather(-1, tokens[..., None]).squeeze(-1)
        out = token_logps(logits, tokens, temperature=temperature)
        assert out.dtype == dtype
        torch.testing.assert_close(out, ref.to(dtype))

    def test_bfloat16_computed_in_float32(self):
        # bf16 logits are upcast before the softmax: the result is float32 and matches the float64
        # reference of the same (bf16-rounded) values to float32 precision, 1e-5.
        logits = random_logits(2, 4, 50, seed=3, scale=5.0, dtype=torch.bfloat16)
        tokens = torch.randint(0, 50, (2, 4), generator=torch.Generator().manual_seed(4))
        ref = torch.log(naive_probs(logits.double())).gather(-1, tokens[..., None]).squeeze(-1)
        out = token_logps(logits, tokens)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)

    @pytest.mark.parametrize("chunk_rows", [1, 2, 3, 100])
    def test_chunked_equals_plain_and_gradient(self, chunk_rows):
        # Chunk boundaries (1, 2, 3 positions, or one block) change nothing, forward or backward;
        # the gradient equals autograd through the naive log_softmax.
        logits = random_logits(2, 5, 7, seed=5, scale=2.0).requires_grad_()
        tokens = torch.randint(0, 7, (2, 5), generator=torch.Generator().manual_seed(6))
        weights = random_logits(2, 5, seed=7)
        out = token_logps(logits, tokens, temperature=0.7, chunk_rows=chunk_rows)
        (out * weights).sum().backward()
        ref_logits = logits.detach().clone().requires_grad_()
        ref = torch.log_softmax(ref_logits / 0.7, -1).gather(-1, tokens[..., None]).squeeze(-1)
        (ref * weights).sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(logits.grad, ref_logits.grad)

    def test_gradcheck_float64(self):
        logits = random_logits(2, 3, 4, seed=8, dtype=torch.float64).requires_grad_()
        tokens = torch.tensor([[0, 3, 1], [2, 2, 0]])
        assert torch.autograd.gradcheck(
            lambda x: token_logps(x, tokens, temperature=1.5, chunk_rows=2), (logits,)
        )

    def test_bfloat16_gradient_dtype(self):
        logits = random_logits(1, 3, 5, seed=9, dtype=torch.bfloat16).requires_grad_()
        token_logps(logits, torch.tensor([[0, 1, 2]])).sum().backward()
        assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
    def test_saves_no_second_full_tensor(self, dtype):
        # For backward, only the input logits themselves (same storage) and (B, T) tensors are saved:
        # no float32 copy of the (B, T, V) logits, even for bf16 input at temperature != 1.
        logits = random_logits(2, 4, 64, seed=33, dtype=dtype).requires_grad_()
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = token_logps(logits, torch.zeros(2, 4, dtype=torch.long), temperature=0.7)
        full = [t for t in saved if t.numel() >= logits.numel()]
        assert len(full) == 1 and full[0].data_ptr() == logits.data_ptr() and full[0].dtype == dtype
        out.sum().backward()
        assert logits.grad.shape == logits.shape

    def test_non_contiguous_shifted_view(self):
        # The caller passes logits[:, :-1] (a non-contiguous view) and tokens[:, 1:].
        full = random_logits(2, 6, 9, seed=10)
        ids = torch.randint(0, 9, (2, 6), generator=torch.Generator().manual_seed(11))
        out = token_logps(full[:, :-1], ids[:, 1:])
        ref = torch.log_softmax(full[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.testing.assert_close(out, ref)

    def test_errors(self):
        logits = torch.zeros(1, 2, 3)
        with pytest.raises(ValueError, match="-100"):
            token_logps(logits, torch.tensor([[0, -100]]))
        with pytest.raises(ValueError, match=r"\[0, 3\)"):
            token_logps(logits, torch.tensor([[0, 3]]))
        with pytest.raises(ValueError, match="shape"):
            token_logps(logits, torch.tensor([[0, 1, 2]]))
        with pytest.raises(ValueError, match="temperature"):
            token_logps(logits, torch.tensor([[0, 1]]), temperature=0.0)


# --------------------------------------------------------------------------------------------------
# topk_tail_logprobs
# --------------------------------------------------------------------------------------------------
class TestTopkTailLogprobs:
    def test_hand_values(self):
        # p = [0.5, 0.3, 0.2]. index [0] -> [ln .5, ln(1 - .5)] = [ln .5, ln .5];
        # index [0, 2] -> [ln .5, ln .2, ln(1 - .7)] = [ln .5, ln .2, ln .3].
        logprobs = torch.log(torch.tensor([0.5, 0.3, 0.2]))
        torch.testing.assert_close(
            topk_tail_logprobs(logprobs, torch.tensor([0])), torch.log(torch.tensor([0.5, 0.5]))
        )
        torch.testing.assert_close(
            topk_tail_logprobs(logprobs, torch.tensor([0, 2])),
            torch.log(torch.tensor([0.5, 0.2, 0.3])),
        )

    def test_matches_naive_batched(self):
        logprobs = torch.log_softmax(random_logits(3, 4, 10, seed=12, scale=2.0, dtype=torch.float64), -1)
        index = logprobs.topk(4, dim=-1).indices  # [3, 4, 4]
        p = logprobs.exp()
        top = p.gather(-1, index)
        ref = torch.log(torch.cat([top, 1 - top.sum(-1, keepdim=True)], -1))
        torch.testing.assert_close(topk_tail_logprobs(logprobs, index), ref)

    def test_tiny_tail_is_accurate_and_floored(self):
        # Tail mass e^-30 (~9.4e-14) is below float32 epsilon: log1p(-sum top) would give -inf or
        # a rounding artefact; the complement logsumexp gives ln(e^-30) = -30 (+ ln 1 of the softmax
        # normaliser, 1 + e^-30 ~ 1). A tail of e^-1000 is below float32 tiny and is floored at
        # ln(1.1755e-38) = -87.3365.
        logits = torch.tensor([[0.0, -30.0], [0.0, -1000.0]])
        out = topk_tail_logprobs(torch.log_softmax(logits, -1), torch.tensor([[0], [0]]))
        floor = LN(torch.finfo(torch.float32).tiny)
        assert floor == pytest.approx(-87.3365, abs=1e-4)
        torch.testing.assert_close(out[:, 1], torch.tensor([-30.0, floor]))

    def test_empty_tail_is_floored_with_finite_gradient(self):
        # index covers the whole vocabulary, or the rest has exactly zero mass (-inf logits):
        # the bucket is the floor, never -inf, and the gradient has no NaN.
        logits = torch.tensor([[1.0, 2.0, float("-inf")]], requires_grad=True)
        logprobs = torch.log_softmax(logits, -1)
        out_all = topk_tail_logprobs(logprobs, torch.tensor([[0, 1, 2]]))
        out_zero = topk_tail_logprobs(logprobs, torch.tensor([[0, 1]]))
        floor = LN(torch.finfo(torch.float32).tiny)
        assert out_all[0, -1] == floor and out_zero[0, -1] == floor
        (out_all[:, :2].sum() + out_all[:, -1].sum() + out_zero.sum()).backward()
        assert torch.isfinite(logits.grad).all()

    def test_shape_mismatch_raises(self):
        with pytest.raises(ValueError, match="leading"):
            topk_tail_logprobs(torch.zeros(2, 5), torch.zeros(3, 1, dtype=torch.long))


# --------------------------------------------------------------------------------------------------
# topk_tail_reverse_kl
# --------------------------------------------------------------------------------------------------
class TestTopkTailReverseKL:
    # teacher p_T = [0.5, 0.3, 0.2], student p_S = [0.25, 0.25, 0.5] (logits = ln p).
    teacher = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    student = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))

    def test_hand_value_k1(self):
        # Teacher top-1 = {0}. Buckets: T~ = [0.5, 0.5], S~ = [0.25, 0.75].
        # KL(S~ || T~) = 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099 = 0.130812.
        out = topk_tail_reverse_kl(self.student, self.teacher, top_k=1)
        assert out.shape == (1, 1)
        torch.testing.assert_close(out, torch.tensor([[0.25 * LN(0.5) + 0.75 * LN(1.5)]]))
        assert out.item() == pytest.approx(0.130812, abs=1e-6)

    def test_hand_value_full(self):
        # k = V = 3: KL(S || T) = 0.25 ln(0.25/0.5) + 0.25 ln(0.25/0.3) + 0.5 ln(0.5/0.2)
        #                       = -0.173287 - 0.045580 + 0.458145 = 0.239278.
        out = topk_tail_reverse_kl(self.student, self.teacher, top_k=3)
        assert out.item() == pytest.approx(0.239278, abs=1e-6)
        # k > V is the same full KL
        torch.testing.assert_close(topk_tail_reverse_kl(self.student, self.teacher, top_k=50), out)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("temperature", TEMPERATURES)
    @pytest.mark.parametrize("k", [1, 3, 7, 8, 30])
    def test_matches_naive(self, dtype, temperature, k):
        # V = 8: k < V is the bucketed KL, k >= V the full reverse KL.
        student = random_logits(2, 3, 8, seed=13, scale=2.0, dtype=dtype)
        teacher = random_logits(2, 3, 8, seed=14, scale=2.0, dtype=dtype)
        out = topk_tail_reverse_kl(student, teacher, top_k=k, temperature=temperature)
        if k >= 8:
            ref = naive_kl(naive_probs(student, temperature), naive_probs(teacher, temperature))
        else:
            ref = naive_bucketed_reverse_kl(student, teacher, k, temperature)
        assert out.dtype == dtype
        atol = 1e-5 if dtype == torch.float32 else 1e-10
        torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-5)

    def test_bfloat16(self):
        # bf16 inputs are upcast; result within 1e-4 of the float64 reference of the rounded values.
        student = random_logits(2, 3, 16, seed=15, scale=2.0, dtype=torch.bfloat16)
        teacher = random_logits(2, 3, 16, seed=16, scale=2.0, dtype=torch.bfloat16)
        out = topk_tail_reverse_kl(student, teacher, top_k=4)
        assert out.dtype == torch.float32
        ref = naive_bucketed_reverse_kl(student.double(), teacher.double(), 4)
        torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=0)

    def test_peaked_teacher_tail_is_finite(self):
        # Teacher puts all its mass on token 0 (gap 1e4): its tail is e^-1e4, floored at ln(tiny).
        # Student p_S = [1/2, 1/8, 1/8, 1/8, 1/8]: S~ = [1/2, 1/2], T~ = [1, tiny].
        # KL = 1/2 ln(1/2 / 1) + 1/2 (ln(1/2) - ln(tiny)) = ln(1/2) + 87.3365/2 = 42.975.
        teacher = torch.tensor([[[1e4, 0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
        student = torch.log(torch.tensor([[[0.5, 0.125, 0.125, 0.125, 0.125]]])).requires_grad_()
        out = topk_tail_reverse_kl(student, teacher, top_k=1)
        expected = LN(0.5) - 0.5 * LN(torch.finfo(torch.float32).tiny)
        assert torch.isfinite(out).all()
        assert out.item() == pytest.approx(expected, rel=1e-5)
        out.sum().backward()
        assert torch.isfinite(student.grad).all() and torch.isfinite(teacher.grad).all()

    def test_both_peaked_is_zero_not_nan(self):
        # Both sides put all mass on the same token: both tails floored, KL = 0 exactly.
        logits = torch.tensor([[[1e4, 0.0, 0.0]]])
        assert topk_tail_reverse_kl(logits, logits.clone(), top_k=1).item() == 0.0

    def test_gradients_reach_both_sides_and_support_is_the_teachers(self):
        student = random_logits(1, 2, 6, seed=17).requires_grad_()
        teacher = random_logits(1, 2, 6, seed=18).requires_grad_()
        topk_tail_reverse_kl(student, teacher, top_k=2).sum().backward()
        assert student.grad.abs().sum() > 0 and teacher.grad.abs().sum() > 0
        # The support is the teacher's top-1 {0}, not the student's top-1 {2}: with the student's
        # support, S~ = [0.5, 0.5], T~ = [0.2, 0.8] and KL = 0.5 ln 2.5 + 0.5 ln 0.625 = 0.223144,
        # not the 0.130812 of test_hand_value_k1.
        out = topk_tail_reverse_kl(self.student, self.teacher, top_k=1)
        assert out.item() == pytest.approx(0.130812, abs=1e-6)
        assert out.item() != pytest.approx(0.223144, abs=1e-3)

    def test_detached_teacher_only_student_gets_gradient(self):
        student = random_logits(1, 2, 6, seed=19).requires_grad_()
        teacher = random_logits(1, 2, 6, seed=20).requires_grad_()
        topk_tail_reverse_kl(student, teacher.detach(), top_k=3).sum().backward()
        assert teacher.grad is None and torch.isfinite(student.grad).all()

    def test_errors(self):
        with pytest.raises(ValueError, match="k must be"):
            topk_tail_reverse_kl(torch.zeros(1, 1, 3), torch.zeros(1, 1, 3), top_k=0)


# --------------------------------------------------------------------------------------------------
# generalized_jsd
# --------------------------------------------------------------------------------------------------
class TestGeneralizedJSD:
    # p_T = [0.5, 0.3, 0.2], p_S = [0.25, 0.25, 0.5]
    teacher = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    student = torch.log(torch.tensor([[[0.25, 0.25, 0.5]]]))

    def test_hand_values_endpoints(self):
        # beta = 0: KL(T || S) = 0.5 ln(0.5/0.25) + 0.3 ln(0.3/0.25) + 0.2 ln(0.2/0.5)
        #                      = 0.346574 + 0.054696 - 0.183258 = 0.218012.
        # beta = 1: KL(S || T) = 0.239278 (see TestTopkTailReverseKL.test_hand_value_full).
        fwd = generalized_jsd(self.student, self.teacher, beta=0.0)
        rev = generalized_jsd(self.student, self.teacher, beta=1.0)
        assert fwd.item() == pytest.approx(0.218012, abs=1e-6)
        assert rev.item() == pytest.approx(0.239278, abs=1e-6)

    def test_hand_value_half(self):
        # V = 2, S = [3/4, 1/4], T = [1/4, 3/4] -> M = [1/2, 1/2].
        # KL(T || M) = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.130812 = KL(S || M) by symmetry,
        # JSD = 0.5 * 0.130812 + 0.5 * 0.130812 = 0.130812.
        s = torch.log(torch.tensor([[[0.75, 0.25]]]))
        t = torch.log(torch.tensor([[[0.25, 0.75]]]))
        out = generalized_jsd(s, t, beta=0.5)
        assert out.item() == pytest.approx(0.25 * LN(0.5) + 0.75 * LN(1.5), abs=1e-6)

    def test_hand_values_exact_zero_mass(self):
        # T = [1/2, 0, 1/2] (a -inf logit), S = [1/3, 1/3, 1/3].
        # beta = 0.5: M = [5/12, 1/6, 5/12].
        #   KL(T || M) = 2 * 1/2 ln((1/2)/(5/12)) = ln 1.2 = 0.182322
        #   KL(S || M) = 2/3 ln((1/3)/(5/12)) + 1/3 ln((1/3)/(1/6)) = 2/3 ln 0.8 + 1/3 ln 2
        #              = -0.148762 + 0.231049 = 0.082287
        #   JSD = 0.5 (0.182322 + 0.082287) = 0.132304
        # beta = 0: KL(T || S) = 2 * 1/2 ln((1/2)/(1/3)) = ln 1.5 = 0.405465 (the 0-mass term is 0)
        # beta = 1: KL(S || T) = +inf (S has mass where T has none): inf, not NaN.
        teacher = torch.tensor([[[0.0, float("-inf"), 0.0]]], requires_grad=True)
        student = torch.zeros(1, 1, 3, requires_grad=True)
        half = generalized_jsd(student, teacher, beta=0.5)
        expected_half = 0.5 * (LN(1.2) + 2 / 3 * LN(0.8) + 1 / 3 * LN(2))
        assert half.item() == pytest.approx(expected_half, abs=1e-6)
        assert expected_half == pytest.approx(0.132304, abs=1e-6)
        fwd = generalized_jsd(student, teacher, beta=0.0)
        assert fwd.item() == pytest.approx(LN(1.5), abs=1e-6)
        assert generalized_jsd(student, teacher, beta=1.0).item() == float("inf")
        (half + fwd).sum().backward()
        assert torch.isfinite(student.grad).all() and torch.isfinite(teacher.grad).all()

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("beta", [0.0, 1e-6, 0.1, 0.5, 0.9, 1 - 1e-6, 1.0])
    @pytest.mark.parametrize("temperature", TEMPERATURES)
    def test_matches_naive(self, dtype, beta, temperature):
        student = random_logits(2, 3, 9, seed=21, scale=2.0, dtype=dtype)
        teacher = random_logits(2, 3, 9, seed=22, scale=2.0, dtype=dtype)
        out = generalized_jsd(student, teacher, beta=beta, temperature=temperature)
        ref = naive_jsd(student, teacher, beta, temperature)
        assert out.dtype == dtype
        if dtype == torch.float64:
            torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-7)
        else:
            torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-5)

    def test_endpoints_exact(self):
        # beta = 0 / 1 are exactly the forward / reverse KL (same float64 value as the naive KL).
        student = random_logits(2, 3, 9, seed=23, dtype=torch.float64)
        teacher = random_logits(2, 3, 9, seed=24, dtype=torch.float64)
        s, t = naive_probs(student), naive_probs(teacher)
        torch.testing.assert_close(generalized_jsd(student, teacher, beta=0), naive_kl(t, s))
        torch.testing.assert_close(generalized_jsd(student, teacher, beta=1), naive_kl(s, t))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_near_endpoints_continuous(self, dtype):
        # The GKD convention is discontinuous at the endpoints by definition (the interior tends to
        # 0); what is continuous is the slope: JSD(beta) = beta KL(T||S) + O(beta^2) and
        # JSD(1 - g) = g KL(S||T) + O(g^2). At beta = 1e-6 the ratio JSD / beta matches KL(T||S) to
        # ~1e-6 relative in float64, and to 1e-3 in float32 (thanks to the log-ratio form; mixing
        # log M first and subtracting it would be off by up to ~20% in float32 on these inputs).
        student = random_logits(2, 3, 9, seed=25, dtype=dtype)
        teacher = random_logits(2, 3, 9, seed=26, dtype=dtype)
        fwd = generalized_jsd(student, teacher, beta=0.0)
        rev = generalized_jsd(student, teacher, beta=1.0)
        near0 = generalized_jsd(student, teacher, beta=1e-6)
        near1 = generalized_jsd(student, teacher, beta=1 - 1e-6)
        assert torch.isfinite(near0).all() and torch.isfinite(near1).all()
        assert (near0 >= 0).all() and (near1 >= 0).all()
        rtol = 1e-5 if dtype == torch.float64 else 1e-3
        torch.testing.assert_close(near0 / 1e-6, fwd, rtol=rtol, atol=0)
        torch.testing.assert_close(near1 / 1e-6, rev, rtol=rtol, atol=0)
        # and monotone towards the endpoints' scale: beta = 1e-3 sits between 0 and its 1/beta slope
        mid = generalized_jsd(student, teacher, beta=1e-3)
        assert (mid > near0).all() and (mid < 1e-3 * fwd * 1.01).all()

    def test_half_bounded_with_tiny_probabilities(self):
        # Probabilities ~1e-6 on one side where the other has ~1: the beta = 0.5 JSD stays in
        # [0, ln 2] (ln 2 is its value for disjoint supports); finite gradient.
        v = 5
        student = torch.full((1, 2, v), LN(1e-6))
        student[..., 0] = 0.0  # S ~ [1, 1e-6, ...]
        teacher = torch.full((1, 2, v), LN(1e-6))
        teacher[..., 1] = 0.0  # T ~ [1e-6, 1, ...]
        teacher[0, 1] = torch.tensor([float("-inf"), 0.0, float("-inf"), float("-inf"), float("-inf")])
        student.requires_grad_()
        out = generalized_jsd(student, teacher, beta=0.5)
        assert (out >= 0).all() and (out <= LN(2) + 1e-6).all()
        assert out[0, 1].item() == pytest.approx(LN(2), abs=1e-4)
        torch.testing.assert_close(out.double(), naive_jsd(student.detach(), teacher, 0.5), atol=1e-6, rtol=0)
        out.sum().backward()
        assert torch.isfinite(student.grad).all()

    def test_bfloat16(self):
        # bf16 inputs: within 1e-5 of the float64 reference of the bf16-rounded logits.
        student = random_logits(2, 3, 16, seed=27, scale=2.0, dtype=torch.bfloat16)
        teacher = random_logits(2, 3, 16, seed=28, scale=2.0, dtype=torch.bfloat16)
        for beta in (0.0, 0.5, 1.0):
            out = generalized_jsd(student, teacher, beta=beta)
            assert out.dtype == torch.float32
            ref = naive_jsd(student.double(), teacher.double(), beta)
            torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("beta", [-0.1, 1.1, float("nan")])
    def test_beta_out_of_range_raises(self, beta):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd(torch.zeros(1, 1, 2), torch.zeros(1, 1, 2), beta=beta)


# --------------------------------------------------------------------------------------------------
# all divergences: identity, shape errors, properties
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_identical_student_teacher_gives_zero(temperature):
    logits = random_logits(2, 3, 8, seed=29, scale=3.0)
    for name, value in divergences(logits, logits.clone(), temperature).items():
        torch.testing.assert_close(value, torch.zeros(2, 3), atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize(
    "fn",
    [
        lambda s, t: topk_tail_reverse_kl(s, t, top_k=2),
        lambda s, t: generalized_jsd(s, t, beta=0.5),
        lambda s, t: generalized_jsd(s, t, beta=0.0),
    ],
    ids=["topk_tail_reverse_kl", "generalized_jsd_0.5", "generalized_jsd_0"],
)
def test_shape_mismatch_raises(fn):
    # vocabulary 7 vs 9: the message names both sizes
    with pytest.raises(ValueError, match=r"7.*9"):
        fn(torch.zeros(1, 2, 7), torch.zeros(1, 2, 9))
    # leading shapes (1, 2) vs (1, 3)
    with pytest.raises(ValueError, match=r"\(1, 2, 7\).*\(1, 3, 7\)"):
        fn(torch.zeros(1, 2, 7), torch.zeros(1, 3, 7))


@settings(max_examples=50, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    scale=st.sampled_from([0.01, 1.0, 10.0, 100.0, 1000.0]),
    peak=st.sampled_from([0.0, 30.0, 1000.0]),
    temperature=st.sampled_from(TEMPERATURES),
    k=st.integers(1, 9),
    beta=st.one_of(st.sampled_from([0.0, 1e-6, 0.5, 1 - 1e-6, 1.0]), st.floats(0.0, 1.0)),
)
def test_property_divergences_nonnegative_and_finite(seed, scale, peak, temperature, k, beta):
    # Random logits of any scale up to 1e3, optionally with one dominant token per position.
    student = random_logits(2, 3, 8, seed=seed, scale=scale)
    teacher = random_logits(2, 3, 8, seed=seed + 1, scale=scale)
    teacher[..., 0] += peak
    values = {
        "topk_tail": topk_tail_reverse_kl(student, teacher, top_k=k, temperature=temperature),
        "jsd": generalized_jsd(student, teacher, beta=beta, temperature=temperature),
    }
    for name, value in values.items():
        assert torch.isfinite(value).all(), name
        assert (value >= -1e-5).all(), (name, value.min().item())
    if 0.0 < beta < 1.0:
        assert (values["jsd"] <= LN(2) + 1e-5).all()


# --------------------------------------------------------------------------------------------------
# masked_mean
# --------------------------------------------------------------------------------------------------
class TestMaskedMean:
    def test_hand_value(self):
        # values [[1, 2, 3]], mask [[1, 0, 1]] -> (1 + 3) / 2 = 2; with num_tokens = 4 -> 4 / 4 = 1.
        values = torch.tensor([[1.0, 2.0, 3.0]])
        mask = torch.tensor([[1, 0, 1]])
        assert masked_mean(values, mask).item() == 2.0
        assert masked_mean(values, mask.bool(), num_tokens=4).item() == 1.0
        assert masked_mean(values, mask, num_tokens=torch.tensor(4)).item() == 1.0

    def test_masked_out_nan_does_not_leak(self):
        # a NaN/inf on a padding position is excluded: (1 + 3) / 2 = 2, finite gradient [1/2, 0, 1/2]
        values = torch.tensor([[1.0, float("nan"), 3.0]], requires_grad=True)
        out = masked_mean(values, torch.tensor([[1, 0, 1]]))
        out.backward()
        assert out.item() == 2.0
        torch.testing.assert_close(values.grad, torch.tensor([[0.5, 0.0, 0.5]]))

    def test_all_masked_is_zero_with_zero_gradient(self):
        values = torch.tensor([[1.0, 2.0]], requires_grad=True)
        for kwargs in ({}, {"num_tokens": 0}):
            values.grad = None
            out = masked_mean(values, torch.zeros(1, 2, dtype=torch.bool), **kwargs)
            out.backward()
            assert out.item() == 0.0
            torch.testing.assert_close(values.grad, torch.zeros(1, 2))

    def test_errors(self):
        with pytest.raises(ValueError, match=r"\(1, 3\).*\(1, 2\)"):
            masked_mean(torch.zeros(1, 3), torch.ones(1, 2))
        with pytest.raises(ValueError, match="num_tokens"):
            masked_mean(torch.zeros(1, 3), torch.ones(1, 3), num_tokens=-1)

    def test_micro_batches_with_global_count_match_one_batch(self):
        # Micro-batch 1 has 10 valid tokens, micro-batch 2 has 1000. Dividing each by the global count
        # 1010 and accumulating gradients reproduces the gradient of the whole batch at once; the naive
        # per-micro-batch mean (Lightning-style average of the two means) weights the 10 tokens 100x
        # more per token and gives a different gradient.
        length = 1000
        w = torch.nn.Parameter(random_logits(length, seed=30))  # one weight per position
        x1, x2 = random_logits(1, length, seed=31), random_logits(1, length, seed=32)
        m1 = torch.zeros(1, length, dtype=torch.bool)
        m1[0, :10] = True
        m2 = torch.ones(1, length, dtype=torch.bool)
        assert int(m1.sum()) + int(m2.sum()) == 1010

        def per_token(x):
            return (w * x) ** 2  # [1, L]

        whole = masked_mean(torch.cat([per_token(x1), per_token(x2)]), torch.cat([m1, m2]))
        (grad_whole,) = torch.autograd.grad(whole, w)

        w.grad = None
        for x, m in ((x1, m1), (x2, m2)):
            masked_mean(per_token(x), m, num_tokens=1010).backward()
        torch.testing.assert_close(w.grad, grad_whole)

        w.grad = None
        for x, m in ((x1, m1), (x2, m2)):
            (masked_mean(per_token(x), m) / 2).backward()
        assert not torch.allclose(w.grad, grad_whole, rtol=1e-2, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# privileged_margin
# --------------------------------------------------------------------------------------------------
class TestPrivilegedMargin:
    # rollout 0: r = 1 (A = +1), delta = teacher - student = [0.5, 0.5] on 2 masked tokens -> D = 0.5
    # rollout 1: r = 0.25 (A = -0.5), delta = [-0.5, -0.5, -0.5] on 3 tokens -> D = -0.5 * -0.5 = 0.25
    # rollout 2: r = 1 but no masked token -> excluded (else Delta would be (0.5 + 0.25 + 0) / 3 = 0.25)
    # Delta = (0.5 + 0.25) / 2 = 0.375
    teacher = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, -1.0, -1.0], [-3.0, -3.0, -3.0]])
    student = torch.tensor([[-1.5, -2.5, 0.0], [-0.5, -0.5, -0.5], [-1.0, -1.0, -1.0]])
    rewards = torch.tensor([1.0, 0.25, 1.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])

    def test_hand_value_and_gradients(self):
        teacher = self.teacher.clone().requires_grad_()
        student = self.student.clone().requires_grad_()
        delta = privileged_margin(teacher, student, self.rewards, self.mask)
        assert delta.shape == ()
        assert delta.item() == pytest.approx(0.375)
        delta.backward()
        # d Delta / d teacher[b, t] = A_b mask[b, t] / count_b / (rollouts with tokens = 2):
        # rollout 0: 1 / 2 / 2 = 0.25; rollout 1: -0.5 / 3 / 2 = -1/12; rollout 2: 0.
        expected = torch.tensor([[0.25, 0.25, 0.0], [-1 / 12] * 3, [0.0] * 3])
        torch.testing.assert_close(teacher.grad, expected)
        assert student.grad is None  # the student side is detached: no gradient path at all

    def test_no_masked_tokens_gives_zero(self):
        teacher = self.teacher.clone().requires_grad_()
        out = privileged_margin(teacher, self.student, self.rewards, torch.zeros(3, 3))
        out.backward()
        assert out.item() == 0.0 and torch.equal(teacher.grad, torch.zeros(3, 3))

    def test_balanced_weighs_successes_and_failures_equally(self):
        # 1 success, 3 failures, 2 tokens each; the teacher lowers every sampled token by c = 0.4:
        # paper: (1 * -0.4 + 3 * (-1) * -0.4) / 4 = 0.2 (positive only because failures outnumber successes);
        # balanced: (-0.4) / 2 + (+0.4) / 2 = 0
        student = torch.full((4, 2), -1.0)
        rewards, mask = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.ones(4, 2)
        assert privileged_margin(student - 0.4, student, rewards, mask).item() == pytest.approx(0.2)
        assert privileged_margin(student - 0.4, student, rewards, mask, weighting="balanced").item() == pytest.approx(0.0)
        # hand value with separation: success delta +0.3 (D = 0.3); failures -0.1, 0.2, 0.5 (D = 0.1, -0.2, -0.5)
        teacher = student + torch.tensor([0.3, -0.1, 0.2, 0.5])[:, None]
        teacher.requires_grad_()
        out = privileged_margin(teacher, student, rewards, mask, weighting="balanced")
        assert out.item() == pytest.approx(0.3 / 2 + (0.1 - 0.2 - 0.5) / 3 / 2)
        out.backward()
        # d/d teacher[b, t] = A_b / (tokens 2) / (rollouts on its side) / 2: success 1/4, failures -1/12
        torch.testing.assert_close(teacher.grad, torch.tensor([[0.25] * 2] + [[-1 / 12] * 2] * 3))

    def test_balanced_gives_zero_without_both_outcomes(self):
        # only failures (or A = 0, r = 0.5, on neither side; or the success without tokens): 0, no gradient
        for rewards in (torch.tensor([0.0, 0.25, 1.0]), torch.tensor([1.0, 0.5, 1.0])):
            teacher = self.teacher.clone().requires_grad_()
            out = privileged_margin(teacher, self.student, rewards, self.mask, weighting="balanced")
            out.backward()
            assert out.item() == 0.0 and torch.equal(teacher.grad, torch.zeros(3, 3))
        rows = torch.tensor([True, True, True])
        assert has_both_outcomes(torch.tensor([1.0, 0.25, 0.0]), rows)
        assert not has_both_outcomes(torch.tensor([1.0, 0.5, 1.0]), rows)
        assert not has_both_outcomes(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([True, False, True]))

    def test_errors(self):
        with pytest.raises(ValueError, match="weighting must be one of paper, balanced"):
            privileged_margin(self.teacher, self.student, self.rewards, self.mask, weighting="equal")
        with pytest.raises(ValueError, match="rewards"):
            privileged_margin(self.teacher, self.student, torch.ones(2), self.mask)
        with pytest.raises(ValueError, match="shape"):
            privileged_margin(self.teacher, self.student[:, :2], self.rewards, self.mask)


# --------------------------------------------------------------------------------------------------
# ppo_clip_loss
# --------------------------------------------------------------------------------------------------
class TestPPOClipLoss:
    # rho = exp(logps - old) in columns: 1.5, 0.5, 1.1 (old = 0, logps = ln rho)
    rho = torch.tensor([1.5, 0.5, 1.1])

    def test_hand_values_symmetric(self):
        # eps = 0.2, clip range [0.8, 1.2].
        # A = +1: rho 1.5 -> -min(1.5, 1.2) = -1.2; rho 0.5 -> -min(0.5, 0.8) = -0.5;
        #         rho 1.1 (inside) -> -1.1
        # A = -1: rho 1.5 -> -min(-1.5, -1.2) = 1.5; rho 0.5 -> -min(-0.5, -0.8) = 0.8; rho 1.1 -> 1.1
        logps = torch.log(self.rho).expand(2, 3).clone().requires_grad_()
        old = torch.zeros(2, 3)
        loss = ppo_clip_loss(logps, old, torch.tensor([1.0, -1.0]))
        torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]]))
        loss.sum().backward()
        # clipped tokens (A=+1, rho=1.5) and (A=-1, rho=0.5) get 0; others d(-rho A)/dlogp = -rho A
        torch.testing.assert_close(logps.grad, torch.tensor([[0.0, -0.5, -1.1], [1.5, 0.0, 1.1]]))
        frac = ppo_clip_fraction(logps, old, torch.tensor([1.0, -1.0]))
        torch.testing.assert_close(frac, torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))

    def test_hand_values_asymmetric(self):
        # eps_low = 0.2, eps_high = 0.28: clip range [0.8, 1.28]; rho = [1.5, 0.5, 1.25].
        # A = +1: -min(1.5, 1.28) = -1.28; -min(0.5, 0.8) = -0.5; 1.25 inside -> -1.25
        #         (with symmetric 0.2 it would be clipped to -1.2)
        # A = -2: -min(-3, -2.56) = 3; -min(-1, -1.6) = 1.6; -min(-2.5, -2.5) = 2.5
        logps = torch.log(torch.tensor([1.5, 0.5, 1.25])).expand(2, 3)
        loss = ppo_clip_loss(logps, torch.zeros(2, 3), torch.tensor([1.0, -2.0]), eps_low=0.2, eps_high=0.28)
        torch.testing.assert_close(loss, torch.tensor([[-1.28, -0.5, -1.25], [3.0, 1.6, 2.5]]))

    def test_per_token_advantages(self):
        # (B, T) advantages: row [1, -1, 2] at rho = [1.5, 0.5, 1.1] -> [-1.2, 0.8, -2.2]
        logps = torch.log(self.rho)[None]
        loss = ppo_clip_loss(logps, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 2.0]]))
        torch.testing.assert_close(loss, torch.tensor([[-1.2, 0.8, -2.2]]))

    def test_on_policy_is_minus_advantage(self):
        # logps == old -> rho = 1 -> loss = -A, gradient -A (the REINFORCE gradient)
        logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        loss = ppo_clip_loss(logps, logps.detach(), torch.tensor([0.7]))
        loss.sum().backward()
        torch.testing.assert_close(loss, torch.tensor([[-0.7, -0.7]]))
        torch.testing.assert_close(logps.grad, torch.tensor([[-0.7, -0.7]]))

    def test_errors(self):
        with pytest.raises(ValueError, match="advantages"):
            ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3))
        with pytest.raises(ValueError, match="old_logps"):
            ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2))
        with pytest.raises(ValueError, match="eps_low"):
            ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), eps_low=1.0)


def test_topk_tail_reverse_kl_with_the_students_support_matches_the_naive_formula():
    student, teacher = random_logits(2, 5, 11, seed=3, scale=2.0), random_logits(2, 5, 11, seed=4, scale=2.0)
    got = topk_tail_reverse_kl(student, teacher, top_k=3, support="student")
    torch.testing.assert_close(got, naive_bucketed_reverse_kl(student, teacher, 3, support="student").float(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, topk_tail_reverse_kl(student, teacher, top_k=3))  # a different support
    with pytest.raises(ValueError, match="support must be 'teacher' or 'student'"):
        topk_tail_reverse_kl(student, teacher, top_k=3, support="both")


# ------------------------------------------------------------------------------------------- k3 KL
def _k3_reference(d: float) -> float:
    """exp(d) - d - 1 in float64 without cancellation: its Taylor series for small |d|, expm1 otherwise."""
    if abs(d) < 1e-3:
        return sum(d**n / math.factorial(n) for n in range(2, 9))
    return math.expm1(d) - d


@pytest.mark.parametrize("d", [1e-8, -1e-8, 1e-6, -1e-6, 3e-4, -3e-4, 9e-3, -9e-3, 1.1e-2, -1.1e-2, 0.5, -0.5, 5.0, -20.0])
def test_k3_kl_matches_the_exact_value_at_every_scale_in_float32(d):
    logps = torch.tensor([[-2.0]], dtype=torch.float32)
    ref = logps + d  # float32: the difference actually stored is what the reference must use
    d_stored = float(ref.double() - logps.double())
    value = float(k3_kl(logps, ref))
    assert value >= 0
    assert value == pytest.approx(_k3_reference(d_stored), rel=2e-5, abs=0)


def test_k3_kl_naive_form_cancels_where_the_stable_one_does_not():
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(10_000, generator=g) * 5
    ref = logps + 1e-4 * torch.randn(10_000, generator=g)
    d = ref - logps
    naive = torch.exp(d) - d - 1.0
    assert int((naive < 0).sum()) > 10  # the fault: the naive float32 form goes negative
    stable = k3_kl(logps, ref)
    assert int((stable < 0).sum()) == 0
    exact = (ref.double() - logps.double()) ** 2 / 2  # to first order at |d| <= 5e-4
    torch.testing.assert_close(stable.double(), exact, rtol=1e-3, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_k3_kl_is_never_negative_over_near_equal_pairs(dtype):
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(200, 500, generator=g) * 5
    scale = torch.logspace(-9, -1, 500)  # differences from 1e-9 to 0.1, both signs
    ref = logps + scale * torch.randn(200, 500, generator=g)
    logps, ref = logps.to(dtype), ref.to(dtype)
    value = k3_kl(logps, ref)
    assert value.dtype == (torch.float32)  # half-precision inputs are computed (and returned) in float32
    assert bool((value >= 0).all()) and bool(torch.isfinite(value).all())
    d = ref.double() - logps.double()  # exact: the inputs as stored
    expected = torch.where(d.abs() < 1e-3, d**2 / 2 + d**3 / 6 + d**4 / 24 + d**5 / 120, torch.expm1(d) - d)
    torch.testing.assert_close(value.double(), expected, rtol=5e-5, atol=1e-30)


def test_k3_kl_gradient_is_one_minus_exp_d_and_the_reference_is_constant():
    logps = torch.tensor([[-1.0, -2.0, -3.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0 + 1e-4, -1.0, -0.5 - 3e-3]], dtype=torch.float64, requires_grad=True)
    k3_kl(logps, ref).sum().backward()
    d = (ref - logps).detach()
    torch.testing.assert_close(logps.grad, 1 - torch.exp(d), rtol=1e-10, atol=1e-15)
    assert ref.grad is None
    with pytest.raises(ValueError, match="differ"):
        k3_kl(torch.zeros(1, 2), torch.zeros(2, 1))


# ---------------------------------------------------------------------------- the composer's terms
def test_anchor_loss_is_the_mean_square_over_kept_latents_only():
    latents = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[0.5, 0.5], [9.0, 9.0]]], requires_grad=True)
    anchor = torch.tensor([[[0.0, 0.0], [3.0, 2.0]], [[0.5, 1.5], [0.0, 0.0]]], requires_grad=True)
    mask = torch.tensor([[True, True], [True, False]])  # the last latent is off: its 81s do not count
    loss = anchor_loss(latents, anchor, mask)
    # kept squares: 1 + 4 + 0 + 4 (row 0), 0 + 1 (row 1) = 10 over 3 latents x 2 coordinates
    assert float(loss.detach()) == pytest.approx(10.0 / 6.0)
    loss.backward()
    expected = torch.tensor([[[1.0, 2.0], [0.0, 2.0]], [[0.0, -1.0], [0.0, 0.0]]]) * 2 / 6
    torch.testing.assert_close(latents.grad, expected)
    assert anchor.grad is None  # sg[c_phi0]
    assert float(anchor_loss(latents, anchor, torch.zeros(2, 2, dtype=torch.bool))) == 0.0  # nothing kept


def test_composer_objective_is_distill_plus_beta_times_the_shortfall_plus_lambda_anchor():
    distill, delta, anchor = torch.tensor(0.3), torch.tensor(0.02, requires_grad=True), torch.tensor(0.5)
    loss = composer_objective(distill, delta, anchor, beta=2.0, margin=0.05, anchor_weight=0.2)
    assert float(loss.detach()) == pytest.approx(0.3 + 2.0 * (0.05 - 0.02) + 0.2 * 0.5)
    loss.backward()
    assert float(delta.grad) == pytest.approx(-2.0)  # raising Delta lowers the loss by beta


# ------------------------------------------------------------------------------ the package's names
def test_the_chunked_kl_is_served_by_losses():
    import lopd_lightning.losses as losses
    import lopd_lightning.losses.lm_head as lm_head
    from lopd_lightning.losses import chunked_topk_tail_reverse_kl

    assert chunked_topk_tail_reverse_kl is lm_head.chunked_topk_tail_reverse_kl
    with pytest.raises(AttributeError):
        losses.no_such_loss  # noqa: B018


def test_the_losses_package_serves_every_public_name_without_a_warning():
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module = importlib.import_module("lopd_lightning.losses")
        for name in module.__all__:
            assert getattr(module, name) is not None, name
