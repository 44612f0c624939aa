"""LOPD's mechanism, measured: how much each teacher context privileges the start student's own trajectories.

    python benchmarks/privileged_margin.py                          # -> benchmarks/results/privileged_margin.json
    python benchmarks/privileged_margin.py --trained-checkpoint runs/compare/lopd/seed_0/checkpoints/last.ckpt
    python benchmarks/privileged_margin.py --contexts latent_trained --trained-checkpoint \
        runs/compare/lopd/seed_{0,1,2}/checkpoints/last.ckpt --out benchmarks/results/privileged_margin_trained.json

On the held-out questions (the val split: 65 for BFCL live_simple; never in the bank or in training), the
start student (``benchmarks/start_student.py``) samples ``--samples`` trajectories per question at
T = 0.7 with the method's top-p / top-k; the task's checker gives the rewards. Then, for each teacher
context, the self-teacher (the start student's weights, ``teacher_mode: live``) scores every token the
student produced, and per token delta = log pi_T(a | s, context) - log pi_S(a | s) (docs/METHOD.md
section 5). Contexts:

- ``text_nearest``: the top-1 retrieved bank experience (exact cosine over MiniLM embeddings of the task
  text) as text, in the framing the latents use ("Here is a reference example ...", "Now complete your
  task.");
- ``text_random``: a random bank experience (never the question's own solution), the same one for every
  trajectory of a question and for the teacher's own answer to it (seeded by the question's id), same
  framing;
- ``text_reference``: the question's own reference solution as an experience (its reference trajectory, as
  ``lopd build-memory --from-references`` records a train question's), as text in the same framing: what the
  teacher of ``configs/experience/opsd_reference.yaml`` reads. A held-out question's record lives in a bank
  used only by this measurement (never by a training run);
- ``latent_reference``: the ``--composer-path`` composer's latents of the question's own record in the first of
  its J slots and its J - 1 nearest bank experiences in the others: what the teacher of an LOPD run with
  self-retrieval (``configs/experience/lopd_paper.yaml``) reads on a train question;
- ``latent_reference_trained``: the same experiences through the first ``--trained-checkpoint``'s composer;
- ``latent_untrained``: the latents of the freshly initialised composer (J experiences, K latents each);
- ``latent_warm_start``: the latents after ``--warm-start-steps`` steps of the composer's warm start
  (L_init on the bank's successful train trajectories);
- ``latent_pretrained``: the composer that ``lopd pretrain-composer`` saved in ``--composer-path`` (its
  ``composer.pt``); null without one;
- ``latent_trained``: the composer of a finished LOPD run (the first ``--trained-checkpoint``); null
  without one. Each further checkpoint is the context ``latent_trained[<run>]``, ``<run>`` the two folders
  above its ``checkpoints/`` (``lopd/seed_1``); with two or more, ``latent_trained_over_seeds`` gives
  each number's mean over them with a 95% Student's t interval (:func:`over_seeds`).
- ``latent_warm_start[<variant>]`` (``--variants``, the investigation of why latents move the teacher so
  little): a composer warm-started like ``latent_warm_start`` with one thing changed: ``gain_embedding``
  (the resampler's output starts at the token embeddings' RMS instead of 1), ``warm_<N>`` (N warm-start
  steps), ``k<N>`` (K = N latents per experience), ``lr<X>`` (the warm start's learning rate X instead of
  ``composer_lr``), or a ``+`` join of them. A variant's resampler starts
  from ``torch.manual_seed(--seed)``, not from the module's own initialisation: ``warm_<--warm-start-steps>``
  is the control that changes nothing else.
  Its latents condition the same teacher as every other context (the start student's weights, not the
  student that run trained), so the contexts differ in nothing else.

Reported per context (``contexts.<name>``):

- ``delta_mean`` and ``delta_ci``: the margin Delta = mean over trajectories of A * (mean delta over its
  tokens), A = 2r - 1 (``--weighting paper``), with a 95% interval from a bootstrap over questions (a
  question's trajectories resampled together);
- ``delta_success`` / ``delta_failure``: the same mean over successful / failed trajectories only;
- ``delta_mixed_groups`` and ``delta_mixed_groups_ci``: Delta over the questions whose samples have mixed
  outcomes, with its interval (a draw without such a question is left out);
- ``separation`` and ``separation_ci``: mean per-token delta on successful trajectories minus that on failed
  ones (how much more the teacher likes what succeeded than what failed: the privilege the margin is meant
  to create; unaffected by how many trajectories fail), with its interval (a draw without both outcomes is
  left out);
  (with binary rewards, the mean of delta_success and delta_failure, i.e. successes and failures weighed
  equally, is this separation measured per trajectory, halved);
- ``delta_balanced`` and ``delta_balanced_ci``: Delta with ``margin_weighting: balanced`` (successes and
  failures weighed equally: the mean of ``delta_success`` and ``delta_failure``), with its interval;
- ``teacher_greedy_success``: the fraction of held-out questions the teacher solves when it answers
  greedily itself with that context; ``teacher_minus_student_greedy`` and its ``_ci``: that fraction minus
  the student's greedy success (``student_greedy_success``) on the same questions, with a 95% paired
  bootstrap interval over questions (``compare_stats.paired_differences``, the comparison's own);
- ``reference_delta_heldout`` / ``reference_delta_train`` and their ``_ci``: the same per-token delta on the
  reference solutions, teacher-forced: those of the held-out questions that pass the checker, and those
  of up to as many train questions the warm start trained on (its draws replayed by
  :func:`warm_start_examples`): how much the context raises the log-probability of the correct answer
  (mean over questions of the mean over its reply tokens; interval from a bootstrap over questions).
  A context that carries the answer's information scores high on both; a composer that fits its warm
  start without generalising, on train only (``n_reference_questions`` gives the two counts);
- ``reference_nll_heldout`` / ``reference_nll_train`` and their ``_ci`` (top level): the start student's
  own negative log-likelihood of those reference solutions with no context (nats per token, mean over
  questions; interval from a bootstrap over questions; None for a split without references): the room
  any context has to raise it;
- ``latent_rms`` (latent contexts): the root-mean-square entry of the latents, against
  ``token_embedding_rms`` at the top level (their scale relative to what the backbone expects).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, package_versions, run_metadata, write_json_atomic  # noqa: E402
from compare_stats import paired_differences, t_interval  # noqa: E402

from lopd_lightning.privilege import reply_outcome, teacher_greedy_reply  # noqa: E402

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
#: bump when this script's warm start of a composer changes (the composer cache's key holds it)
CACHE_VERSION = 2
CONTEXTS = ("text_nearest", "text_random", "text_reference", "latent_untrained", "latent_warm_start", "latent_pretrained",
            "latent_reference", "latent_trained", "latent_reference_trained")
#: the contexts that read the question's own reference solution (a record of a bank used only here)
REFERENCE_CONTEXTS = ("text_reference", "latent_reference", "latent_reference_trained")


# ---------------------------------------------------------------------------------------- statistics
#: one trajectory: (reward, mean token delta, sum of its token deltas, its token count)
Trajectory = tuple[float, float, float, int]


def trajectory_stats(per_question: dict[str, list[Trajectory]], subset: str = "all") -> float | None:
    """Delta over the trajectories of ``per_question`` ({question: [trajectory, ...]}): the mean over
    trajectories of A * (mean delta over the trajectory's tokens), A = 2r - 1 (docs/METHOD.md 5).

    Args:
        subset: "all", "success" (r >= 1), "failure" (r < 1) or "mixed" (questions with both outcomes).

    Returns:
        The mean of A * delta over the chosen trajectories, or None when there is none.
    """
    values = []
    for trajectories in per_question.values():
        outcomes = {t[0] >= 1.0 for t in trajectories}
        if subset == "mixed" and len(outcomes) < 2:
            continue
        for r, d, *_ in trajectories:
            if (subset == "success" and r < 1.0) or (subset == "failure" and r >= 1.0):
                continue
            values.append((2 * r - 1) * d)
    return sum(values) / len(values) if values else None


def balanced_stats(per_question: dict[str, list[Trajectory]]) -> float | None:
    """Delta with ``margin_weighting: balanced`` (docs/METHOD.md 5): half the mean of A * delta over the
    successful trajectories (r >= 1) plus half that over the failed ones, a side without trajectories
    counting 0. Pooled over the whole measurement, where both sides exist; in training each step's batch is
    weighed on its own and a batch with one outcome gives 0. Binary rewards: the sides equal src's split by
    the sign of A."""
    sides = [trajectory_stats(per_question, "success"), trajectory_stats(per_question, "failure")]
    if all(side is None for side in sides):
        return None
    return sum(0.5 * side for side in sides if side is not None)


def separation(per_question: dict[str, list[Trajectory]]) -> float | None:
    """The per-token mean delta over every token of the successful trajectories minus that over every
    token of the failed ones (no outcome weight; None without both outcomes)."""
    sums = {True: 0.0, False: 0.0}
    counts = {True: 0, False: 0}
    for trajectories in per_question.values():
        for r, _, total, n in trajectories:
            sums[r >= 1.0] += total
            counts[r >= 1.0] += n
    if not counts[True] or not counts[False]:
        return None
    return sums[True] / counts[True] - sums[False] / counts[False]


def bootstrap_ci(per_question: dict[str, list[Trajectory]], *, resamples: int, seed: int,
                 statistic=trajectory_stats) -> list[float] | None:
    """A 95% percentile interval of ``statistic`` (Delta) from ``resamples`` bootstrap draws of the questions."""
    keys = sorted(per_question)
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        sample = {f"{i}": per_question[rng.choice(keys)] for i in range(len(keys))}
        value = statistic(sample)
        if value is not None:
            draws.append(value)
    if not draws:
        return None
    draws.sort()
    return [draws[int(0.025 * (len(draws) - 1))], draws[int(math.ceil(0.975 * (len(draws) - 1)))]]


def mixed_stats(per_question: dict[str, list[Trajectory]]) -> float | None:
    """Delta over the questions whose trajectories have both outcomes (:func:`trajectory_stats`, "mixed")."""
    return trajectory_stats(per_question, "mixed")


def summarise(per_question: dict[str, list[Trajectory]], *, resamples: int, seed: int) -> dict[str, Any]:
    def ci(statistic):
        return bootstrap_ci(per_question, resamples=resamples, seed=seed, statistic=statistic)

    return {
        "delta_mean": trajectory_stats(per_question),
        "delta_ci": ci(trajectory_stats),
        "delta_success": trajectory_stats(per_question, "success"),
        "delta_failure": trajectory_stats(per_question, "failure"),
        "delta_mixed_groups": mixed_stats(per_question),
        "delta_mixed_groups_ci": ci(mixed_stats),
        "separation": separation(per_question),
        "separation_ci": ci(separation),
        "delta_balanced": balanced_stats(per_question),
        "delta_balanced_ci": ci(balanced_stats),
    }


# ---------------------------------------------------------------------------------------- the model side
def build_module(args: argparse.Namespace):
    from lopd_lightning.modules import LOPDModule

    return LOPDModule(
        str(args.student), lora=LORA, group_size=args.samples, temperature=0.7, top_p=0.95, top_k=20,
        max_new_tokens=args.max_new_tokens, num_latents=args.num_latents, num_experiences=args.num_experiences,
        composer_depth=8, max_experience_tokens=192, embedder="minilm", warm_start_steps=args.warm_start_steps,
        warm_start_batch_size=2, composer_lr=1e-4, teacher_mode="live", seed=args.seed,
        context_framing=getattr(args, "context_framing", "short"),
        **({"composer_architecture": args.composer_architecture} if getattr(args, "composer_architecture", None) else {}),
    )


def fill_bank(module, task) -> int:
    """The bank of the evidence runs: the train split's reference trajectories that score 1."""
    records = []
    for example in task.examples("train"):
        messages, reward = module.reference_trajectory(task, example)
        if reward >= 1.0:
            record = module.experience_from_trajectory(task, example, messages, reward)
            if record is not None:
                records.append(record)
    module.bank.add(records)
    return len(records)


def own_records(module, task, examples) -> dict[str, Any]:
    """Each question's own reference solution as an experience record ({id: Experience}; a question whose
    reference does not pass the checker has none): the record ``lopd build-memory --from-references`` makes of a
    train question, here for any question, in a bank used only by this measurement."""
    out = {}
    for example in examples:
        messages, reward = module.reference_trajectory(task, example)
        if reward >= 1.0:
            record = module.experience_from_trajectory(task, example, messages, reward)
            if record is not None:
                out[example.id] = record
    return out


def reference_experiences(module, task, example, own: dict[str, Any]) -> list:
    """The J experiences of a question under self-retrieval: its own record first, then its J - 1 nearest other
    bank experiences (the bank never holds a held-out question's record)."""
    others = module.retrieve(task, [example])[0]
    record = own.get(example.id)
    return ([record] if record is not None else []) + others[: module.hparams.num_experiences - (record is not None)]


def student_token_logps(module, batch):
    """The student's log-probability of each of the batch's assistant tokens, no context: ``(logps, mask)``,
    both (B, T-1) in shifted coordinates (logps 0 off the mask)."""
    import torch

    from lopd_lightning.lm import unpack
    from lopd_lightning.losses import token_logps

    targets, mask = module.shifted(batch)
    with torch.no_grad():
        return unpack(token_logps(module.student_forward(batch, mask).values[None], targets[mask][None])[0], mask), mask


def token_deltas(module, batch, contexts: dict[str, Any], *, student=None) -> dict[str, list[tuple[float, float, int]]]:
    """Per trajectory and context, (the mean over its assistant tokens of log pi_T - log pi_S, their sum,
    the token count).

    ``contexts`` maps a name to ``("text", [ids per row])`` or ``("latent", composer)``; ``student``: the
    batch's :func:`student_token_logps`, when already computed.
    """
    import torch

    from lopd_lightning.lm import unpack
    from lopd_lightning.losses import token_logps

    student, mask = student if student is not None else student_token_logps(module, batch)
    tokens = module.shifted(batch)[0][mask]
    counts = mask.sum(dim=1).clamp_min(1).float()
    out: dict[str, list[float]] = {}
    with torch.no_grad():
        for name, (kind, value) in contexts.items():
            kwargs: dict[str, Any] = {"positions": module.unshift(mask)}
            if kind == "text":
                kwargs["context_ids"] = value
            else:
                composed = latents_of(module, batch, value)
                kwargs.update(latents=composed.latents, latent_mask=composed.latent_mask)
            logits = module.teacher.logits_on_student_positions(
                batch.input_ids, batch.attention_mask, batch.context_position, **kwargs
            )
            teacher = unpack(token_logps(logits[None], tokens[None])[0], mask)
            sums = ((teacher - student) * mask).sum(dim=1)
            out[name] = list(zip((sums / counts).tolist(), sums.tolist(), mask.sum(dim=1).tolist(), strict=True))
    return out


def latents_of(module, batch, value):
    """The latents of a ``("latent", value)`` context: ``value`` a composer reading the rows' retrieved experiences
    (``batch.experiences``), or ``(composer, experiences)`` reading the given ones (B lists of records)."""
    if isinstance(value, tuple):
        composer, experiences = value
        pairs = [[(meta["task_text"], e.trace) for e in row] for meta, row in zip(batch.metadata, experiences, strict=True)]
        return composer.compose(pairs)
    return module.batch_latents(batch, value)


def student_reference_nll(module, batch, *, student=None) -> list[tuple[float, float, int]]:
    """Per row of a batch of reference solutions, the student's own negative log-likelihood of its assistant
    tokens with no context: (the mean over those tokens, in nats per token; their sum; the token count).
    ``student``: the batch's :func:`student_token_logps`, when already computed."""
    logps, mask = student if student is not None else student_token_logps(module, batch)
    sums = -(logps * mask).sum(dim=1)
    counts = mask.sum(dim=1)
    return list(zip((sums / counts.clamp_min(1)).tolist(), sums.tolist(), counts.tolist(), strict=True))


def teacher_contexts(module, batch, composers: dict[str, Any], *, seed: int,
                     text: tuple[str, ...] = ("text_nearest", "text_random"), own: dict[str, Any] | None = None,
                     task=None, examples: dict[str, Any] | None = None) -> dict[str, Any]:
    """The text contexts named in ``text`` and every composer's latents for ``batch`` (its rows'
    retrieved experiences; for the :data:`REFERENCE_CONTEXTS`, :func:`reference_experiences` of each row's
    question, ``examples`` by id, its own record from ``own``), as :func:`token_deltas` takes them."""
    contexts: dict[str, Any] = {}
    if "text_reference" in text:
        records = [(own or {}).get(example_id) for example_id in batch.example_ids]
        contexts["text_reference"] = ("text", module.teacher.encode_text_context(
            [r.trace if r is not None else None for r in records]))
    if "text_nearest" in text:
        nearest = [exps[0].trace if exps else None for exps in batch.experiences]
        contexts["text_nearest"] = ("text", module.teacher.encode_text_context(nearest))
    if "text_random" in text:
        randoms = [random_record(module, seed, example_id).trace for example_id in batch.example_ids]
        contexts["text_random"] = ("text", module.teacher.encode_text_context(randoms))
    for name, composer in composers.items():
        if name in REFERENCE_CONTEXTS:
            experiences = [reference_experiences(module, task, examples[example_id], own or {})
                           for example_id in batch.example_ids]
            contexts[name] = ("latent", (composer, experiences))
        else:
            contexts[name] = ("latent", composer)
    return contexts


def warm_start_examples(module, datamodule, n: int) -> list:
    """The first ``n`` distinct train examples that ``module.warm_start_composer(datamodule)`` trains on, in
    the order it draws them (:meth:`~lopd_lightning.modules.LOPDModule.warm_start_draws`), so every
    composer warm-started here, the variants with more steps included, has fitted these."""
    seen = dict.fromkeys(record.task_id for batch in module.warm_start_draws(datamodule) for record in batch)
    return [datamodule.example(task_id) for task_id in seen][:n]


def random_record(module, seed: int, example_id: str):
    """The ``text_random`` experience of a question: one bank record drawn by a generator seeded with the
    question's id (the same for its trajectories and for the teacher's own answer)."""
    records = [record for record in module.bank.records if record.task_id != example_id]  # a train question's own
    return records[random.Random(f"{seed}:{example_id}").randrange(len(records))]  # solution is not "random"


def latent_rms(module, composer, batch) -> float:
    import torch

    with torch.no_grad():
        composed = module.batch_latents(batch, composer)
        keep = composed.latent_mask
        return float(composed.latents[keep].pow(2).mean().sqrt()) if keep.any() else float("nan")


def composer_on_adapter(module, source: str, name: str, *, num_latents: int | None = None, output_gain: float | str = 1.0):
    """A composer like ``module.composer`` on the same backbone (no second one): adapter ``source``'s LoRA
    copied to adapter ``name`` (frozen, as :func:`~lopd_lightning.adapters.copy_adapter` leaves it) and a
    fresh compressor with K = ``num_latents`` (default the module's) and ``output_gain``."""
    from lopd_lightning.adapters import copy_adapter
    from lopd_lightning.composer import LatentComposer

    copy_adapter(module.backbone, source, name)
    return LatentComposer(module.backbone, module.tokenizer, adapter_name=name, architecture=module.composer.architecture,
                          num_latents=num_latents or module.composer.num_latents, depth=module.hparams.composer_depth,
                          output_gain=output_gain, max_experience_tokens=module.composer.max_experience_tokens)


def snapshot_composer(module, name: str):
    """A frozen copy of ``module.composer`` (its LoRA as adapter ``name``, and its resampler)."""
    frozen = composer_on_adapter(module, module.composer.adapter_name, name)
    frozen.compressor.load_state_dict(module.composer.compressor.state_dict())
    frozen.requires_grad_(False)
    return frozen


def parse_variant(spec: str, *, warm_start_steps: int, num_latents: int) -> dict[str, Any]:
    """A composer variant of the investigation, e.g. ``gain_embedding``, ``warm_100``, ``k32``, ``lr1e-3`` or
    a ``+`` join of them: the output gain ("embedding": the latents start at the token embeddings' RMS), the
    warm start's length, K and the warm start's learning rate (the module's ``warm_start_lr`` otherwise); what
    a variant does not name is the measurement's own setting. The batch size is not a part: the train
    references are the draws of the module's warm start, which a longer warm start extends and another
    learning rate repeats, but another batch size would not.

    Raises:
        SystemExit: an unknown part (one line naming ``--variants``).
    """
    options: dict[str, Any] = {"output_gain": 1.0, "warm_start_steps": warm_start_steps, "num_latents": num_latents}
    for part in filter(None, spec.split("+")):  # "": the measurement's own settings
        if part == "gain_embedding":
            options["output_gain"] = "embedding"
        elif part.startswith("warm_") and part[5:].isdigit():
            options["warm_start_steps"] = int(part[5:])
        elif part.startswith("k") and part[1:].isdigit() and int(part[1:]) >= 1:
            options["num_latents"] = int(part[1:])
        elif re.fullmatch(r"lr\d+(\.\d+)?(e-?\d+)?", part) and 0 < float(part[2:]) < math.inf:
            options["composer_lr"] = float(part[2:])  # only when named: the kept composers' keys stay as they were
        else:
            raise SystemExit(f"error: --variants: unknown part {part!r} of {spec!r}; use gain_embedding, warm_<steps>, "
                             "k<latents>, lr<learning rate>, joined by +")
    return options


def warm_started_variant(module, datamodule, spec: str, options: dict[str, Any], *, seed: int,
                         cache: ComposerCache | None = None):
    """A composer built like the module's (an untrained LoRA copy, a fresh resampler seeded by ``seed``) with
    ``options``, warm-started as the module's was (or its weights from ``cache``, when a previous run of the
    same settings kept them); the module's own composer is left as it was."""
    import torch

    from lopd_lightning.adapters import adapter_parameters

    name = "variant_" + "".join(c if c.isalnum() else "_" for c in spec)
    torch.manual_seed(seed)  # the resampler's initialisation
    variant = composer_on_adapter(module, module.anchor_composer.adapter_name, name,  # the untrained composer LoRA
                                  num_latents=options["num_latents"], output_gain=options["output_gain"])
    def warm_start() -> None:
        for param in adapter_parameters(module.backbone, name):
            param.requires_grad_(True)
        hp = module.hparams
        own, steps, lr = module.composer, hp.warm_start_steps, hp.warm_start_lr
        module.composer, hp.warm_start_steps = variant, options["warm_start_steps"]
        hp.warm_start_lr = options.get("composer_lr", lr)
        try:
            module.warm_start_composer(datamodule)
        finally:
            module.composer, hp.warm_start_steps, hp.warm_start_lr = own, steps, lr

    if cache is None:
        warm_start()
    else:
        cache.load_or_warm_start(spec, variant, options, warm_start)
    variant.requires_grad_(False)
    for param in adapter_parameters(module.backbone, name):
        param.requires_grad_(False)
    return variant


class ComposerCache:
    """Warm-started composers kept in ``<work-dir>/composers/``, so that a run stopped part-way (or one with
    other ``--variants``) does not redo a warm start it already paid for: one file per composer holding its
    resampler's and its LoRA adapter's weights, and the settings that produced them (the ``src/`` hash, this
    script's :data:`CACHE_VERSION`, the module's hyperparameters, the library versions, the student, and the
    composer's own options). A file of other settings, other shapes, or one that cannot be read is ignored
    (and overwritten after a new warm start); the journal's fingerprints still check that what is loaded is
    what was scored. ``--fresh`` discards the journal, not these (delete the folder to warm-start again).
    """

    def __init__(self, folder: Path, key: dict[str, Any]):
        self.folder, self.key = Path(folder), key

    def _path(self, name: str) -> Path:
        return self.folder / ("".join(c if c.isalnum() or c in "_-" else "_" for c in name) + ".pt")

    def load(self, name: str, composer, options: dict[str, Any]) -> bool:
        """Load ``name``'s kept weights into ``composer`` (nothing is touched unless every tensor's name and
        shape match); False when none were kept under these settings."""
        import torch

        path = self._path(name)
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # missing, cut short or written by another torch: warm-start again
            return False
        if not isinstance(saved, dict) or saved.get("key") != {**self.key, "name": name, "options": options}:
            return False
        own_resampler = composer.compressor.state_dict()
        lora = composer.lora_parameters()
        kept_resampler, kept_lora = saved.get("resampler", {}), saved.get("lora", [])
        if (set(kept_resampler) != set(own_resampler)
                or any(kept_resampler[k].shape != v.shape for k, v in own_resampler.items())
                or len(kept_lora) != len(lora) or any(k.shape != p.shape for k, p in zip(kept_lora, lora))):
            return False
        composer.compressor.load_state_dict(kept_resampler)
        with torch.no_grad():
            for param, value in zip(lora, kept_lora, strict=True):
                param.copy_(value)
        return True

    def load_or_warm_start(self, name: str, composer, options: dict[str, Any], warm_start) -> bool:
        """Load ``name``'s kept weights into ``composer``, or call ``warm_start()`` and keep what it made.
        Returns whether they were loaded."""
        if self.load(name, composer, options):
            return True
        warm_start()
        self.save(name, composer, options)
        return False

    def save(self, name: str, composer, options: dict[str, Any]) -> None:
        import torch

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(name)
        state = {"key": {**self.key, "name": name, "options": options},
                 "resampler": {k: v.detach().cpu().clone() for k, v in composer.compressor.state_dict().items()},
                 "lora": [p.detach().cpu().clone() for p in composer.lora_parameters()]}
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic: a kill mid-write leaves no half file


def load_trained_composer(module, checkpoint: Path) -> int:
    """Load the composer (its LoRA and resampler) of an LOPD checkpoint into ``module.composer``; the
    student's weights stay the start student's. Returns the number of tensors loaded."""
    import torch

    def is_composer(key: str) -> bool:
        return key.startswith("composer.") or ".composer." in key

    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    loaded = {k: v for k, v in state.items() if is_composer(k)}
    own = [k for k in module.state_dict() if is_composer(k)]
    unknown, absent = [k for k in loaded if k not in own], [k for k in own if k not in loaded]
    if not loaded or unknown or absent:  # an incomplete one would keep the previous composer's weights
        raise ValueError(f"{checkpoint} holds no composer of this module's shape (unknown keys: {unknown[:3]}, "
                         f"missing keys: {absent[:3]})")
    module.load_state_dict(loaded, strict=False)
    return len(loaded)


def trained_context_names(checkpoints: list[Path]) -> list[str]:
    """``latent_trained`` for the first checkpoint, ``latent_trained[<run>]`` for each further one (``<run>``
    the two folders above ``checkpoints/``, ``<method>/seed_<s>`` in a compare.py grid, else the file's stem;
    ``#<i>`` appended where two would clash)."""
    names: list[str] = []
    for i, path in enumerate(checkpoints):
        path = Path(path)
        run = (f"{path.parent.parent.parent.name}/{path.parent.parent.name}" if path.parent.name == "checkpoints"
               else path.stem)
        name = "latent_trained" if i == 0 else f"latent_trained[{run}]"
        names.append(name if name not in names else f"latent_trained[{run}#{i}]")
    return names


#: The numbers of a context that :func:`over_seeds` averages.
OVER_SEEDS_KEYS = ("delta_mean", "delta_success", "delta_failure", "delta_mixed_groups", "separation",
                   "delta_balanced", "teacher_greedy_success", "latent_rms", "reference_delta_heldout",
                   "reference_delta_train")


def over_seeds(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each of :data:`OVER_SEEDS_KEYS` over several trained composers' contexts (one per LOPD seed):
    ``{"contexts": names, "<key>": {"mean", "ci" (95% Student's t over the composers, unclipped), "values"}}``;
    a key some context lacks (or has as None) is left out."""
    out: dict[str, Any] = {"contexts": list(entries)}
    for key in OVER_SEEDS_KEYS:
        values = [entry.get(key) for entry in entries.values()]
        if any(v is None for v in values):
            continue
        out[key] = {"mean": sum(values) / len(values), "ci": t_interval(values, lower=-math.inf, upper=math.inf),
                    "values": values}
    return out


# ---------------------------------------------------------------------------------------- resume
class Journal:
    """Finished work of one measurement, appended line by line to ``<work-dir>/journal.jsonl``, so that a run
    stopped part-way (a session's end) continues where it stopped: the scores of each batch of questions,
    each batch of teacher-forced reference solutions, and each greedy answer (the student's and every
    teacher's), are kept once written.

    The first line holds what decides the numbers (task, student, checkpoint, settings) and a fingerprint of
    each composer; a journal written under other settings, or by a warm start that does not reproduce, is
    refused (``--fresh`` starts over).
    """

    def __init__(self, folder: Path, key: dict[str, Any], *, fresh: bool):
        self.path = Path(folder) / "journal.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if fresh and self.path.exists():
            self.path.unlink()
        self.lines: list[dict[str, Any]] = self._read() if self.path.exists() else []
        saved = self.lines[0].get("key") if self.lines else None
        if self.lines and saved != key:
            differ = sorted(k for k in {*(saved or {}), *key} if (saved or {}).get(k) != key.get(k))
            raise SystemExit(f"error: {self.path} was written with other settings ({', '.join(differ)} differ); "
                             "pass --fresh to start over or --work-dir for a separate measurement")
        if not self.lines:
            self.append({"kind": "header", "key": key})

    def _read(self) -> list[dict[str, Any]]:
        """The journal's lines; a last line cut short (a process killed while writing it) is dropped and cut
        from the file, so that the next line starts on its own."""
        text = self.path.read_text()
        complete, _, tail = text.rpartition("\n")
        lines = []
        for number, line in enumerate(complete.split("\n") if complete else [], start=1):
            if line.strip():
                try:
                    lines.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise SystemExit(f"error: line {number} of {self.path} is not JSON ({err}); pass --fresh to "
                                     "start over") from None
        if tail:
            self.path.write_text(complete + "\n" if complete else "")
        return lines

    def append(self, line: dict[str, Any]) -> None:
        self.lines.append(line)
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def check_fingerprints(self, fingerprints: dict[str, float]) -> None:
        """Record the composers' fingerprints, or refuse to continue with composers that differ from them."""
        saved = next((line["values"] for line in self.lines if line["kind"] == "fingerprints"), None)
        if saved is None:
            self.append({"kind": "fingerprints", "values": fingerprints})
        elif any(not math.isclose(saved.get(k, float("nan")), v, rel_tol=1e-5, abs_tol=1e-6) for k, v in fingerprints.items()):
            raise SystemExit(f"error: the composers differ from those {self.path} was scored with ({saved} against "
                             f"{fingerprints}): the warm start did not reproduce; pass --fresh to start over")

    def batches(self, kind: str, split: str | None = None) -> dict[int, dict[str, Any]]:
        """The lines of ``kind`` (``"scores"``, ``"reference"`` or ``"reference_nll"``; of ``split`` for the
        references) by batch number."""
        return {line["batch"]: line for line in self.lines
                if line["kind"] == kind and (split is None or line.get("split") == split)}

    def greedy(self) -> dict[tuple[str, str], float]:
        return {(line["who"], line["id"]): line["reward"] for line in self.lines if line["kind"] == "greedy"}

    def timings(self) -> tuple[dict[str, float], int, bool]:
        """Seconds per phase summed over every session that wrote this journal: ``(timings, sessions, complete)``.

        Each session's start (``setup_s``, ``warm_start_s``, ``warm_start[<variant>]_s``) is a ``"session"`` line;
        each unit of work carries the ``"seconds"`` it took (``scores``: ``sample_and_score_s``; ``reference``
        and ``reference_nll``: ``references_s``; ``greedy``: ``student_greedy_s`` or ``teacher_greedy_<who>_s``).
        ``complete`` is False when a work line has no ``"seconds"`` or the journal has no ``"session"`` line (a journal
        older than them): the phases then count only what was recorded. Not counted in any case: a unit of work
        killed before its line was written, and the loading of pretrained or trained composers.
        """
        totals: dict[str, float] = {}
        sessions, complete = 0, True
        phases = {"scores": "sample_and_score_s", "reference": "references_s", "reference_nll": "references_s"}
        for line in self.lines:
            kind = line["kind"]
            if kind == "session":
                sessions += 1
                for phase, seconds in line["seconds"].items():
                    totals[phase] = totals.get(phase, 0.0) + seconds
                continue
            if kind == "greedy":
                phase = "student_greedy_s" if line["who"] == "student" else f"teacher_greedy_{line['who']}_s"
            elif kind in phases:
                phase = phases[kind]
            else:
                continue
            if "seconds" not in line:
                complete = False
                continue
            totals[phase] = totals.get(phase, 0.0) + line["seconds"]
        return totals, sessions, complete and sessions > 0


def journal_key(args: argparse.Namespace, heldout: list) -> dict[str, Any]:
    """What decides a measurement's numbers (a journal of other settings, or of other code under src/, is
    refused)."""
    from compare_runs import src_provenance

    checkpoints = args.trained_checkpoint or []  # one checkpoint keeps the key of journals written before several
    trained_stamp = [file_stamp(c) for c in checkpoints] if len(checkpoints) > 1 else file_stamp(next(iter(checkpoints), None))
    chosen = sorted({c.strip() for c in args.contexts.split(",") if c.strip()})
    contexts = {"contexts": chosen} if chosen else {}  # all contexts: the key's format of older journals
    return {"src_hash": src_provenance()["src_hash"], "task": args.task, "student": file_stamp(args.student), "questions": [ex.id for ex in heldout],
            "samples": args.samples, "num_latents": args.num_latents, "num_experiences": args.num_experiences,
            "warm_start_steps": args.warm_start_steps, "max_new_tokens": args.max_new_tokens,
            "batch_questions": args.batch_questions, "seed": args.seed,
            "trained_checkpoint": trained_stamp, "variants": args.variants, **contexts,
            **({"composer_path": file_stamp(args.composer_path / "composer.pt")} if getattr(args, "composer_path", None) else {}),
            **({"composer_architecture": args.composer_architecture} if getattr(args, "composer_architecture", None) else {}),
            **({"context_framing": args.context_framing} if getattr(args, "context_framing", "short") != "short" else {})}


def warm_start_key(args: argparse.Namespace, module) -> dict[str, Any]:
    """What decides a warm-started composer's weights (the composer cache's key): the code (``src/`` hash,
    :data:`CACHE_VERSION`), the libraries, the student, the module's hyperparameters (LoRA, composer, warm
    start, retrieval, seed); not the held-out questions, the sampling or the variants measured beside it."""
    from compare_runs import src_provenance

    return {"src_hash": src_provenance()["src_hash"], "version": CACHE_VERSION, "libraries": package_versions(),
            "task": args.task, "student": file_stamp(args.student),
            "hparams": json.loads(json.dumps(dict(module.hparams), sort_keys=True, default=str))}


def collect_scores(journal: Journal):
    """Per context {question: [trajectory, ...]}, the student's sampled rewards per question, and the latents'
    RMS per batch, from the journal's scores."""
    per_question: dict[str, dict[str, list[Trajectory]]] = {name: {} for name in CONTEXTS}
    for line in journal.batches("scores").values():
        for row in line["rows"]:
            for name in row["deltas"]:
                per_question.setdefault(name, {})
    student_rewards: dict[str, list[float]] = {}
    rms: dict[str, list[float]] = {}
    for line in sorted(journal.batches("scores").values(), key=lambda line: line["batch"]):
        for row in line["rows"]:
            student_rewards.setdefault(row["id"], []).append(row["reward"])
            for name, (mean, total, n) in row["deltas"].items():
                per_question[name].setdefault(row["id"], []).append((row["reward"], mean, total, int(n)))
        for name, value in line["rms"].items():
            rms.setdefault(name, []).append(value)
    return per_question, student_rewards, rms


def composer_fingerprint(composer) -> float:
    """The sum of |weight| over a composer's resampler and its LoRA adapter: equal composers, equal sums."""
    total = sum(float(p.detach().abs().sum()) for p in composer.compressor.parameters())
    return total + sum(float(p.detach().abs().sum()) for p in composer.lora_parameters())


def file_stamp(path: Path | None) -> list[Any] | None:
    """A file's (or a model folder's weights') resolved path, size and modification time."""
    if path is None:
        return None
    path = Path(path)
    target = path / "model.safetensors" if path.is_dir() else path
    stat = target.stat() if target.exists() else None
    return [str(path.resolve()), stat.st_size if stat else None, int(stat.st_mtime) if stat else None]


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="bfcl_live_simple")
    parser.add_argument("--student", type=Path, default=REPO_ROOT / "runs" / "evidence" / "sft_student")
    parser.add_argument("--samples", type=int, default=4, help="trajectories per held-out question (T = 0.7)")
    parser.add_argument("--questions", type=int, default=None, help="the first N held-out questions (default all)")
    parser.add_argument("--num-latents", type=int, default=8, help="K")
    parser.add_argument("--num-experiences", type=int, default=2, help="J")
    parser.add_argument("--warm-start-steps", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-questions", type=int, default=4, help="questions sampled and scored at once")
    parser.add_argument("--trained-checkpoint", type=Path, nargs="+", default=None,
                        help="LOPD checkpoints (last.ckpt) whose composers are measured: the first as latent_trained, "
                             "each further one as latent_trained[<run folder>]")
    parser.add_argument("--composer-path", type=Path, default=None,
                        help="a folder of `lopd pretrain-composer` (composer.pt), measured as latent_pretrained")
    parser.add_argument("--composer-architecture", default=None,
                        help="model.init_args.composer_architecture of the module (default: LOPDModule's); "
                             "perceiver reproduces the committed results of the paper's composer")
    parser.add_argument("--contexts", default="", help="comma-separated contexts to measure (default all); a name "
                        "without [...] also selects its bracketed variants, e.g. latent_trained")
    parser.add_argument("--context-framing", default="short",
                        help="model.init_args.context_framing of the teacher (short, from_scratch): the framing of every "
                             "context, text and latents; from_scratch is configs/experience/lopd_paper.yaml's")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "privileged_margin.json")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "runs" / "evidence" / "privileged_margin",
                        help="the journal of finished work: a stopped run continues from it")
    parser.add_argument("--fresh", action="store_true", help="discard the journal and start over (the warm-started "
                        "composers kept in <work-dir>/composers are still used; delete that folder to warm-start again)")
    parser.add_argument("--variants", default="", help="comma-separated composer variants, each warm-started and "
                        "measured as context latent_warm_start[<variant>] (gain_embedding, warm_<steps>, k<latents>, "
                        "lr<learning rate>, joined by +)")
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.contexts.split(",") if c.strip()]
    unknown = [c for c in chosen if c.split("[")[0] not in CONTEXTS]
    if unknown:
        parser.error(f"--contexts: unknown {', '.join(unknown)}; choose from {', '.join(CONTEXTS)}")
    if args.composer_path is not None and not (args.composer_path / "composer.pt").is_file():
        parser.error(f"--composer-path {args.composer_path} holds no composer.pt; make it with `lopd pretrain-composer`")
    for checkpoint in args.trained_checkpoint or []:
        if not Path(checkpoint).is_file():
            parser.error(f"--trained-checkpoint {checkpoint} is not a file; pass an LOPD run's checkpoints/last.ckpt")

    def selected(name: str) -> bool:
        return not chosen or name in chosen or name.split("[")[0] in chosen

    import lightning as L
    import torch

    from lopd_lightning.data import OnPolicyDataModule
    from lopd_lightning.lm import base_model
    from lopd_lightning.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    if not (args.student / "config.json").exists():
        raise SystemExit(f"error: no start student at {args.student}; make it with `python benchmarks/start_student.py`")
    L.seed_everything(args.seed)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    task = get_task(args.task)
    module = build_module(args)
    module.eval()
    n_bank = fill_bank(module, task)
    heldout = task.examples("val")[: args.questions]
    timings["setup_s"] = time.perf_counter() - t0

    # the anchor c_phi0 is the snapshot taken at construction: the untrained composer (warm_start_composer
    # is called directly here, so the anchor is not refreshed after it)
    composers: dict[str, Any] = {"latent_untrained": module.anchor_composer}
    t0 = time.perf_counter()
    dm = OnPolicyDataModule(task, examples_per_step=1, seed=args.seed)
    cache = ComposerCache(args.work_dir / "composers", warm_start_key(args, module))
    own = parse_variant("", warm_start_steps=args.warm_start_steps, num_latents=args.num_latents)
    if cache.load_or_warm_start("latent_warm_start", module.composer, own, lambda: module.warm_start_composer(dm)):
        module.warm_started = True
    timings["warm_start_s"] = time.perf_counter() - t0
    composers["latent_warm_start"] = snapshot_composer(module, "composer_warm_start")
    for spec in filter(None, (v.strip() for v in args.variants.split(","))):
        options = parse_variant(spec, warm_start_steps=args.warm_start_steps, num_latents=args.num_latents)
        t0 = time.perf_counter()
        composers[f"latent_warm_start[{spec}]"] = warm_started_variant(module, dm, spec, options, seed=args.seed,
                                                                       cache=cache)
        timings[f"warm_start[{spec}]_s"] = time.perf_counter() - t0
    if args.composer_path is not None:
        from lopd_lightning.composer import load_composer

        pretrained = composer_on_adapter(module, module.composer.adapter_name, "composer_pretrained")
        load_composer(pretrained, args.composer_path, key="--composer-path")
        pretrained.requires_grad_(False)
        composers["latent_pretrained"] = pretrained
        composers["latent_reference"] = pretrained  # the same composer, reading the question's own record
    checkpoints = args.trained_checkpoint or []
    for i, (name, checkpoint) in enumerate(zip(trained_context_names(checkpoints), checkpoints, strict=True)):
        load_trained_composer(module, checkpoint)
        composers[name] = snapshot_composer(module, f"composer_trained_{i}")  # the next load overwrites module.composer
        if i == 0:
            composers["latent_reference_trained"] = composers[name]
    absent = [c for c in chosen if c not in CONTEXTS and c not in composers]
    if absent:
        parser.error(f"--contexts: no context {', '.join(absent)} in this run (its composers: {', '.join(composers)})")
    composers = {name: c for name, c in composers.items() if selected(name)}
    names = [name for name in (*CONTEXTS, *(n for n in composers if n not in CONTEXTS)) if selected(name)]
    text_contexts = tuple(name for name in ("text_nearest", "text_random", "text_reference") if name in names)
    by_id = {example.id: example for example in (*heldout, *task.examples("train"))}
    own = own_records(module, task, heldout) if any(n in REFERENCE_CONTEXTS for n in names) else {}
    journal = Journal(args.work_dir, journal_key(args, heldout), fresh=args.fresh)
    journal.check_fingerprints({name: composer_fingerprint(c) for name, c in composers.items()})
    journal.append({"kind": "session", "seconds": {k: round(v, 3) for k, v in timings.items()}})

    done = journal.batches("scores")
    for b, i in enumerate(range(0, len(heldout), args.batch_questions)):
        if b in done:
            continue
        examples = heldout[i : i + args.batch_questions]
        t0 = time.perf_counter()
        with torch.no_grad():
            batch = module.make_batch(task, examples)  # rollout seeds hash (seed, step 0, question, sample)
        contexts = teacher_contexts(module, batch, composers, seed=args.seed, text=text_contexts, own=own, task=task,
                                    examples=by_id)
        deltas = token_deltas(module, batch, contexts)
        rows = [{"id": example_id, "reward": float(reward), "deltas": {name: deltas[name][row] for name in contexts}}
                for row, (example_id, reward) in enumerate(zip(batch.example_ids, batch.rewards.tolist(), strict=True))]
        rms = {name: latent_rms(module, c, batch) for name, c in composers.items() if name not in REFERENCE_CONTEXTS}
        seconds = time.perf_counter() - t0
        journal.append({"kind": "scores", "batch": b, "rows": rows, "rms": rms, "seconds": seconds})
        print(f"scored {min(i + args.batch_questions, len(heldout))}/{len(heldout)} questions ({seconds:.0f} s this batch)",
              flush=True)
    per_question, student_rewards, rms = collect_scores(journal)

    # the reference solutions, teacher-forced: how much each context raises the log-probability of the
    # correct answer, on the held-out questions (those whose reference passes the checker) and on as many
    # train questions as the warm start drew (its own data)
    references: dict[str, dict[str, dict[str, list[Trajectory]]]] = {}
    solvable = [example for example in heldout if module.reference_trajectory(task, example)[1] >= 1.0]
    reference_sets = {"heldout": solvable, "train": warm_start_examples(module, dm, len(heldout))}
    reference_nll: dict[str, dict[str, list[Trajectory]]] = {}  # the student's own, no context
    for split, examples in reference_sets.items():
        done, done_nll = journal.batches("reference", split), journal.batches("reference_nll", split)
        for b, i in enumerate(range(0, len(examples), args.batch_questions)):
            if b in done and b in done_nll:
                continue
            chunk = examples[i : i + args.batch_questions]
            t0 = time.perf_counter()
            with torch.no_grad():
                batch = module.reference_batch(task, chunk)
                student = student_token_logps(module, batch)
                if b not in done:
                    batch.experiences = module.retrieve(task, chunk)
                    own_here = {**own, **own_records(module, task, [e for e in chunk if e.id not in own])} \
                        if any(n in REFERENCE_CONTEXTS for n in names) else {}
                    contexts = teacher_contexts(module, batch, composers, seed=args.seed, text=text_contexts,
                                                own=own_here, task=task, examples=by_id)
                    deltas = token_deltas(module, batch, contexts, student=student)
                    journal.append({"kind": "reference", "split": split, "batch": b, "rows": [
                        {"id": example_id, "deltas": {name: value[row] for name, value in deltas.items()}}
                        for row, example_id in enumerate(batch.example_ids)], "seconds": time.perf_counter() - t0})
                    t0 = time.perf_counter()
                if b not in done_nll:
                    nll = student_reference_nll(module, batch, student=student)
                    journal.append({"kind": "reference_nll", "split": split, "batch": b, "rows": [
                        {"id": example_id, "nll": value} for example_id, value in zip(batch.example_ids, nll, strict=True)],
                        "seconds": time.perf_counter() - t0})
        for line in journal.batches("reference", split).values():
            for row in line["rows"]:
                for name, (mean, total, n) in row["deltas"].items():
                    references.setdefault(name, {}).setdefault(split, {})[row["id"]] = [(1.0, mean, total, int(n))]
        for line in journal.batches("reference_nll", split).values():
            for row in line["rows"]:
                mean, total, n = row["nll"]
                reference_nll.setdefault(split, {})[row["id"]] = [(1.0, mean, total, int(n))]

    # greedy success: the student's own (the rollout code) and each teacher's (its context in the prompt)
    answered = journal.greedy()
    todo = [example for example in heldout if ("student", example.id) not in answered]
    for i in range(0, len(todo), 16):
        t0 = time.perf_counter()
        rewards = module.evaluate_examples(task, todo[i : i + 16]).rewards.tolist()
        seconds = (time.perf_counter() - t0) / len(rewards)  # the batch's time, shared by its answers
        for example, r in zip(todo[i : i + 16], rewards, strict=True):
            journal.append({"kind": "greedy", "who": "student", "id": example.id, "reward": float(r), "seconds": seconds})
    answered = journal.greedy()
    student_greedy = [answered[("student", example.id)] for example in heldout]
    teacher_success: dict[str, float] = {}
    for name in names:
        if name.startswith("latent") and name not in composers:
            continue
        for example in heldout:
            if (name, example.id) in answered:
                continue
            t0 = time.perf_counter()
            if name == "text_nearest":
                exps = module.retrieve(task, [example])[0]
                ids = module.teacher.encode_text_context([exps[0].trace if exps else None])[0]
                reply = teacher_greedy_reply(module, task, example, context_ids=ids, max_new_tokens=args.max_new_tokens)
            elif name == "text_random":
                ids = module.teacher.encode_text_context([random_record(module, args.seed, example.id).trace])[0]
                reply = teacher_greedy_reply(module, task, example, context_ids=ids, max_new_tokens=args.max_new_tokens)
            elif name == "text_reference":
                record = own.get(example.id)
                ids = module.teacher.encode_text_context([record.trace if record is not None else None])[0]
                reply = teacher_greedy_reply(module, task, example, context_ids=ids, max_new_tokens=args.max_new_tokens)
            elif name in REFERENCE_CONTEXTS:
                experiences = reference_experiences(module, task, example, own)
                composed = composers[name].compose([[(example.text, e.trace) for e in experiences]])
                reply = teacher_greedy_reply(module, task, example, composed=composed,
                                             max_new_tokens=args.max_new_tokens)
            else:
                reply = teacher_greedy_reply(module, task, example, composer=composers[name],
                                             max_new_tokens=args.max_new_tokens)
            reward, _ = reply_outcome(task, example, reply)
            journal.append({"kind": "greedy", "who": name, "id": example.id, "reward": reward,
                            "seconds": time.perf_counter() - t0})
        answers = journal.greedy()
        solved = sum(answers[(name, example.id)] >= 1.0 for example in heldout)
        teacher_success[name] = solved / len(heldout)
        print(f"teacher greedy {name}: {solved}/{len(heldout)}", flush=True)

    answered = journal.greedy()
    session_timings, sessions, timings_complete = journal.timings()
    embed = base_model(module.backbone).get_input_embeddings().weight
    results: dict[str, Any] = {
        "task": args.task,
        "student": str(args.student.relative_to(REPO_ROOT) if args.student.is_relative_to(REPO_ROOT) else args.student),
        "n_questions": len(heldout),
        "n_trajectories": sum(len(v) for v in student_rewards.values()),
        "n_mixed_groups": sum(len({r >= 1.0 for r in v}) == 2 for v in student_rewards.values()),
        "student_sampled_success": sum(r >= 1.0 for v in student_rewards.values() for r in v)
        / max(1, sum(len(v) for v in student_rewards.values())),
        "student_greedy_success": sum(r >= 1.0 for r in student_greedy) / len(heldout),
        "bank_size": n_bank,
        "n_reference_questions": {split: len(examples) for split, examples in reference_sets.items()},
        "settings": {"samples": args.samples, "temperature": 0.7, "top_p": 0.95, "top_k": 20,
                     "num_latents": args.num_latents, "num_experiences": args.num_experiences,
                     "warm_start_steps": args.warm_start_steps, "max_new_tokens": args.max_new_tokens,
                     "teacher_mode": "live", "weighting": "paper (A = 2r - 1); delta_balanced: balanced",
                     "variants": args.variants, "resamples": args.resamples,
                     "context_framing": args.context_framing,
                     "own_reference_records": len(own) if any(n in REFERENCE_CONTEXTS for n in names) else None},
        "token_embedding_rms": float(embed.detach().pow(2).mean().sqrt()),
        "contexts": {},
        "timings_s": {k: round(v, 1) for k, v in session_timings.items()},
        "timings_sessions": sessions,
        "timings_complete": timings_complete,
    }
    for split in reference_sets:  # the student's own NLL of the references: a plain mean over questions
        per_reference = reference_nll.get(split)
        results[f"reference_nll_{split}"] = trajectory_stats(per_reference) if per_reference else None
        results[f"reference_nll_{split}_ci"] = (bootstrap_ci(per_reference, resamples=args.resamples, seed=args.seed)
                                                if per_reference else None)
    for name in names:
        if not per_question.get(name) and name.startswith("latent"):
            results["contexts"][name] = None
            source = "--composer-path of `lopd pretrain-composer`" if name in ("latent_pretrained", "latent_reference") else \
                "--trained-checkpoint of an LOPD run"
            results.setdefault("notes", []).append(f"{name}: no composer (pass {source})")
            continue
        entry = summarise(per_question[name], resamples=args.resamples, seed=args.seed)
        entry["teacher_greedy_success"] = teacher_success.get(name)
        if name in teacher_success:
            paired = paired_differences({ex.id: float(answered[(name, ex.id)] >= 1.0) for ex in heldout},
                                        {ex.id: float(answered[("student", ex.id)] >= 1.0) for ex in heldout},
                                        n_boot=args.resamples, seed=args.seed)
            entry["teacher_minus_student_greedy"] = paired["mean_difference"]
            entry["teacher_minus_student_greedy_ci"] = paired["ci"]
        if name in rms:
            entry["latent_rms"] = sum(rms[name]) / len(rms[name])
        for split, per_reference in references.get(name, {}).items():
            entry[f"reference_delta_{split}"] = trajectory_stats(per_reference)
            entry[f"reference_delta_{split}_ci"] = bootstrap_ci(per_reference, resamples=args.resamples, seed=args.seed)
        results["contexts"][name] = entry
    trained = {name: entry for name, entry in results["contexts"].items()
               if name.split("[")[0] == "latent_trained" and entry is not None}
    if len(trained) > 1:
        results["latent_trained_over_seeds"] = over_seeds(trained)
    results.update(run_metadata(seed=args.seed, argv=argv))
    write_json_atomic(results, args.out)
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
