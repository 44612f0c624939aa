"""Where LOPD's self-teacher disagrees with the student on the student's own replies (issue 33's format collapse).

    PYTHONPATH=<the run's src> python benchmarks/teacher_bias.py --run runs/experience/lopd/seed_0 \
        --checkpoint runs/experience/lopd/seed_0/checkpoints/evaluated.ckpt \
        --replies runs/experience/lopd/seed_0/generations/val_step_0.jsonl \
        --questions 32 --out benchmarks/results/teacher_bias_hidden_rules.json

On hidden_rules, LOPD's student learned to write the tool schema's ``"required": [...]`` list inside a call's
``arguments`` and lost the call format (benchmarks/README.md, "The experience comparison"). LOPD's student loss
is the top-M + tail reverse KL to the teacher on the student's own tokens (docs/METHOD.md section 5, Eq. 10),
so the student moves where the teacher puts more probability than it does. This measures that, on the
student's replies of a generations file of the run (one greedy reply per held-out question), teacher-forced,
for each *state* and each teacher *context*.

States (``--states``):
  ``start``: the run's start student and the pretrained composer (``composer_path``) with the initial bank,
  the teacher of the run's first step; ``end``: everything of the checkpoint (student, composer, bank);
  ``end_composer``: the start student with the checkpoint's composer (the composer's own drift alone).

Contexts of the teacher (a ``live`` teacher: the student's weights; other teacher modes are refused):
  ``none``: nothing inserted, the alignment check (must equal the student: ``alignment_max_abs_logp``);
  ``framing_only``: the latent contexts' framing text with no latent slot (what every latent context adds
  besides its latents); ``latent``: the latents the training step inserts (the row's retrieved experiences,
  top-J, through the state's composer, after the student's key/value prefix as in the step);
  ``latent_wrong``: the latents of the next question's experiences (over the whole question set);
  ``latent_noise``: Gaussian latents with each slot's norm; ``text_nearest``: the top-1 retrieved trajectory
  as text (OPSD's context on this task).

Per context, means over questions with a 95% percentile bootstrap interval over questions (``mean``, ``ci``,
``n``, ``positive_fraction``):
  ``logp_delta``: mean over reply tokens of log p_T - log p_S (nats per token, temperature 1);
  ``reverse_kl``: the training loss's per-token top-M + tail KL(p_S || p_T) (M = the run's distill_top_k, at
  its distill_temperature), nats per token;
  at the token that closes the call's ``arguments`` (the first token holding ``}`` after ``"arguments"``; rows
  without one are left out, so ``n`` may be smaller): ``close_logp_delta`` (log p_T - log p_S of that token),
  ``comma_mass_student`` / ``comma_mass_teacher`` / ``comma_mass_delta`` (the probability of the tokens that go
  on with another key: their text, after any leading quote or space, starts with a comma) and
  ``close_reverse_kl``;
  ``required_logratio_delta``: the same reply with ``, "required": [<the schema's list>]`` added inside
  ``arguments`` against the clean reply, (log p_T(corrupt) - log p_T(clean)) - (log p_S(corrupt) -
  log p_S(clean)), nats per reply: > 0 means the teacher prefers the schema-copying reply more than the
  student does; ``required_logratio_student``: the student's own log-ratio.

The ``src`` measured is the one Python imports (``PYTHONPATH``): its hash is recorded as ``src_hash``.
Bad input (a missing run, checkpoint or config, an unreadable or empty replies file, an unknown state or
context, a count below 1) exits with one ``error:`` line naming the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402

CONTEXTS = ("none", "framing_only", "latent", "latent_wrong", "latent_noise", "text_nearest")
STATES = ("start", "end", "end_composer")


class InputError(ValueError):
    """Bad input: the message is the one ``error:`` line main prints."""


# ---------------------------------------------------------------------------------------- replies
def read_replies(path: Path, n: int | None) -> list[dict[str, Any]]:
    """The first ``n`` (all when None) replies of a generations file (one JSON object per line, as
    ``save_generations`` writes them) that are single-turn and whose call closes its ``arguments`` with ``}}``.

    Returns:
        [{"example_id": str, "messages": [system, user, assistant], "reward": float}].

    Raises:
        InputError: a line that is not a JSON object with ``example_id``, ``messages`` and ``reward``.
    """
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            example_id, messages, reward = row["example_id"], row["messages"], float(row["reward"])
            roles, reply = [m["role"] for m in messages], messages[-1]["content"]
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise InputError(f"--replies: line {number} of {path} is not a generations record with example_id, "
                             f"messages and reward ({type(exc).__name__}: {exc}); give a val_step_<n>.jsonl of a run") from None
        if roles != ["system", "user", "assistant"] or corrupt_reply(reply, ["x"]) is None:
            continue
        rows.append({"example_id": example_id, "messages": messages, "reward": reward})
        if n is not None and len(rows) == n:
            break
    return rows


def corrupt_reply(reply: str, required: list[str]) -> str | None:
    """``reply`` with ``, "required": [...]`` added as the last key of the first call's ``arguments``
    (before the ``}}`` that closes them), or None when the reply has no such place."""
    at = reply.find("}}")
    if at < 0 or '"arguments": {' not in reply[:at]:
        return None
    return reply[:at] + ', "required": ' + json.dumps(required) + reply[at:]


def schema_required(system_prompt: str, reply: str) -> list[str]:
    """The ``required`` list of the called tool's schema in the system prompt (``[]`` when not found)."""
    try:
        name = json.loads(reply.split("<tool_call>")[1].split("</tool_call>")[0])[0]["name"]
        tools = json.loads(system_prompt.split("<tools>")[1].split("</tools>")[0])
    except (IndexError, KeyError, TypeError, ValueError):
        return []
    for tool in tools:
        if tool.get("name") == name:
            return list(tool.get("parameters", {}).get("required", []))
    return []


def close_index(tokens: list[str]) -> int | None:
    """The index, among a reply's decoded tokens, of the first token holding the ``}`` that closes
    ``arguments`` (the first ``}`` once ``"arguments"`` has been written), or None."""
    text = ""
    for i, piece in enumerate(tokens):
        if "}" in piece and '"arguments"' in text:
            return i
        text += piece
    return None


# ---------------------------------------------------------------------------------------- the module
def build_state(state: str, checkpoint: Path):
    """The LOPD module of ``state`` (the module docstring's states) from an LOPD checkpoint, in eval mode,
    HF backend. Returns ``(module, the checkpoint's global step)``.

    Raises:
        InputError: the checkpoint is not an LOPD one; its teacher is not ``live`` (the measure reuses the
            student's key/value prefix, valid only when the teacher has the student's weights); ``start`` of a
            run without ``composer_path`` (its start composer was warm-started inside fit and not kept).
    """
    import torch

    from lopd_lightning.modules import LOPDModule

    ckpt = torch.load(checkpoint, map_location="cpu", weights_only=False)
    if "lopd_state" not in ckpt or "composer_path" not in ckpt.get("hyper_parameters", {}):
        raise InputError(f"--checkpoint: {checkpoint} is not an LOPD checkpoint; give <run>/checkpoints/last.ckpt of an LOPD run")
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    if hparams.get("teacher_mode", "live") != "live":
        raise InputError(f"--checkpoint: the run's teacher_mode is {hparams['teacher_mode']!r}; this measure needs a "
                         "live teacher (the student's weights)")
    if state == "start" and not hparams.get("composer_path"):
        raise InputError("--states: start needs a run with model.init_args.composer_path (a run that warm-started "
                         "its composer inside fit keeps no start composer); measure end and end_composer")
    hparams["generation_backend"] = "hf"
    module = LOPDModule(**hparams)
    if state in ("end", "end_composer"):
        saved = ckpt["state_dict"]
        if state == "end_composer":
            saved = {k: v for k, v in saved.items() if k.startswith("composer.") or ".composer." in k}
        _, unexpected = module.load_state_dict(saved, strict=state == "end")
        if unexpected:
            raise InputError(f"--checkpoint: {checkpoint} holds keys this module does not have: {unexpected[:3]}")
        if state == "end":
            module.load_method_state(ckpt["lopd_state"])
    module.eval()
    return module, int(ckpt.get("global_step", -1))


def make_batch(module, task, examples: dict[str, Any], rows: list[dict[str, Any]], *, corrupt: bool):
    """The teacher-forced :class:`~lopd_lightning.rollout.RolloutBatch` of ``rows`` (their replies, or the
    schema-copying ones with ``corrupt``), annotated with each row's task text and retrieved experiences."""
    from lopd_lightning.rollout import batch_from_conversations

    chosen = [examples[row["example_id"]] for row in rows]
    conversations = []
    for row in rows:
        system, _, reply = (m["content"] for m in row["messages"])
        if corrupt:
            reply = corrupt_reply(reply, schema_required(system, reply))
        conversations.append([*row["messages"][:2], {"role": "assistant", "content": reply}])
    batch = batch_from_conversations(
        module.tokenizer, conversations, rewards=[row["reward"] for row in rows], group_ids=list(range(len(rows))),
        example_ids=[ex.id for ex in chosen], tools=[task.tools(ex) for ex in chosen],
    )
    module.annotate(batch, chosen)
    batch.experiences = module.retrieve(task, chosen)
    return batch


def teacher_kwargs(module, batch, context: str, *, wrong: list | None, seed: int) -> dict[str, Any]:
    """The keyword arguments of ``module.teacher.on_student_positions`` that insert ``context`` for ``batch``
    (``wrong``: the experiences ``latent_wrong`` composes, one list per row)."""
    import torch

    if context == "none":
        return {}
    if context == "framing_only":
        framing = module.teacher.framing
        return {"context_ids": [framing.prefix_ids + framing.suffix_ids for _ in range(len(batch))]}
    if context == "text_nearest":
        return {"context_ids": module.teacher.encode_text_context([e[0].trace if e else None for e in batch.experiences])}
    if context == "latent_wrong":
        original, batch.experiences = batch.experiences, wrong
        try:
            composed = module.batch_latents(batch)
        finally:
            batch.experiences = original
        return {"latents": composed.latents, "latent_mask": composed.latent_mask}
    composed = module.batch_latents(batch)
    latents = composed.latents
    if context == "latent_noise":
        noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed), dtype=latents.dtype)
        latents = noise / noise.norm(dim=-1, keepdim=True) * latents.norm(dim=-1, keepdim=True)
    return {"latents": latents, "latent_mask": composed.latent_mask}


def score_batch(module, batch, corrupt_batch, contexts: tuple[str, ...], *, wrong: list, seed: int,
                comma_ids) -> dict[str, dict[str, list[float]]]:
    """The measures of the module docstring for one batch of questions.

    Args:
        batch, corrupt_batch: :func:`make_batch` of the same rows, clean and with ``corrupt``.
        wrong: ``latent_wrong``'s experiences, one list per row.
        comma_ids: (C,) long, :func:`comma_token_ids`.

    Returns:
        {context: {measure: [one float per row]}}: the closing-token measures only for rows with a closing
        token; ``alignment_max_abs_logp`` (``none``): one value, the batch's largest.
    """
    import torch

    from lopd_lightning.lm import unpack
    from lopd_lightning.losses import token_logps, topk_tail_reverse_kl
    from lopd_lightning.teacher import prefix_length
    from lopd_lightning.teacher.prefix_cache import TeacherPrefix

    top_k, tau = int(module.hparams.distill_top_k), float(module.hparams.distill_temperature)
    out: dict[str, dict[str, list[float]]] = {c: {} for c in contexts}
    sequence_logp: dict[str, dict[str, Any]] = {}  # {clean|corrupt: {context|"student": (B,) sums}}
    with torch.no_grad():
        for which, b in (("clean", batch), ("corrupt", corrupt_batch)):
            targets, mask = module.shifted(b)
            student = module.student_forward(b, mask, keep_cache=True)  # as in the step: the student's prefix
            prefix = TeacherPrefix.from_cache(student.cache, prefix_length(b.attention_mask, b.context_position))
            s_logits, tokens = student.values, targets[mask]  # (N, V), (N,)
            s_lp = token_logps(s_logits[None], tokens[None])[0]
            sequence_logp.setdefault(which, {})["student"] = (unpack(s_lp, mask) * mask).sum(dim=1)
            counts = mask.sum(dim=1)
            offsets = torch.cumsum(counts, 0) - counts  # row r's tokens are [offsets[r], offsets[r] + counts[r])
            for context in contexts:
                t_logits = module.teacher.on_student_positions(
                    b.input_ids, b.attention_mask, b.context_position, positions=module.unshift(mask), prefix=prefix,
                    **teacher_kwargs(module, b, context, wrong=wrong, seed=seed),
                )
                t_lp = token_logps(t_logits[None], tokens[None])[0]
                sequence_logp[which][context] = (unpack(t_lp, mask) * mask).sum(dim=1)
                if which == "corrupt":
                    continue
                rows = out[context]
                if context == "none":
                    rows["alignment_max_abs_logp"] = [float((t_lp - s_lp).abs().max())]
                rkl = topk_tail_reverse_kl(s_logits[None], t_logits[None], top_k=top_k, temperature=tau)[0]  # (N,)
                rows.setdefault("logp_delta", []).extend(((unpack(t_lp - s_lp, mask) * mask).sum(1) / counts.clamp_min(1)).tolist())
                rows.setdefault("reverse_kl", []).extend(((unpack(rkl, mask) * mask).sum(1) / counts.clamp_min(1)).tolist())
                p_s, p_t = s_logits.softmax(-1), t_logits.softmax(-1)
                for r in range(len(b)):
                    ids = tokens[offsets[r] : offsets[r] + counts[r]].tolist()
                    i = close_index([module.tokenizer.decode([t]) for t in ids])
                    if i is None:
                        continue
                    n = int(offsets[r]) + i
                    comma_s, comma_t = float(p_s[n, comma_ids].sum()), float(p_t[n, comma_ids].sum())
                    rows.setdefault("close_logp_delta", []).append(float(t_lp[n] - s_lp[n]))
                    rows.setdefault("comma_mass_student", []).append(comma_s)
                    rows.setdefault("comma_mass_teacher", []).append(comma_t)
                    rows.setdefault("comma_mass_delta", []).append(comma_t - comma_s)
                    rows.setdefault("close_reverse_kl", []).append(float(rkl[n]))
    student_ratio = sequence_logp["corrupt"]["student"] - sequence_logp["clean"]["student"]
    for context in contexts:
        teacher_ratio = sequence_logp["corrupt"][context] - sequence_logp["clean"][context]
        out[context]["required_logratio_delta"] = (teacher_ratio - student_ratio).tolist()
        out[context]["required_logratio_student"] = student_ratio.tolist()
    return out


def comma_token_ids(tokenizer):
    """(C,) long: the ids of the tokens whose text, after any leading quote or space, starts with a comma."""
    import torch

    return torch.tensor([i for i in range(len(tokenizer)) if tokenizer.decode([i]).lstrip(' "').startswith(",")])


def bootstrap(values: list[float], *, resamples: int, seed: int) -> dict[str, Any]:
    """The mean of ``values`` with a 95% percentile bootstrap interval: {"mean", "ci": [lo, hi], "n",
    "positive_fraction"} ({"mean": None, "ci": None, "n": 0} for no values)."""
    import numpy as np

    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return {"mean": None, "ci": None, "n": 0}
    means = x[np.random.default_rng(seed).integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return {"mean": float(x.mean()), "ci": [float(lo), float(hi)], "n": int(x.size), "positive_fraction": float((x > 0).mean())}


def check_inputs(args: argparse.Namespace) -> tuple[Path, list[str], tuple[str, ...], dict[str, Any]]:
    """The checkpoint, states, contexts and the run's data config; one :class:`InputError` per bad input."""
    if not args.run.is_dir():
        raise InputError(f"--run: no folder {args.run}; give an LOPD run folder (runs/<root>/lopd/seed_<s>)")
    checkpoint = args.checkpoint or args.run / "checkpoints" / "last.ckpt"
    if not checkpoint.is_file():
        raise InputError(f"--checkpoint: no file {checkpoint}; give the run's checkpoints/last.ckpt or evaluated.ckpt")
    if not args.replies.is_file():
        raise InputError(f"--replies: no file {args.replies}; give a generations file, <run>/generations/val_step_<n>.jsonl")
    for flag, value in (("--questions", args.questions), ("--batch-questions", args.batch_questions),
                        ("--resamples", args.resamples)):
        if value < 1:
            raise InputError(f"{flag}: must be at least 1, got {value}")
    states = [s for s in args.states.split(",") if s]
    contexts = tuple(c for c in args.contexts.split(",") if c)
    for flag, given, known in (("--states", states, STATES), ("--contexts", contexts, CONTEXTS)):
        if unknown := sorted(set(given) - set(known)):
            raise InputError(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        if not given:
            raise InputError(f"{flag}: empty; give some of {', '.join(known)}")
    config_path = args.run / "config.yaml"
    try:
        import yaml

        data = yaml.safe_load(config_path.read_text())["data"]["init_args"]
        data["task"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise InputError(f"--run: {config_path} is not a run's config with data.init_args.task ({type(exc).__name__}); "
                         "give the folder `lopd fit` wrote") from None
    return checkpoint, states, contexts, data


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="an LOPD run folder (config.yaml, checkpoints/)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default <run>/checkpoints/last.ckpt")
    parser.add_argument("--replies", type=Path, required=True, help="a generations file (val_step_<n>.jsonl)")
    parser.add_argument("--questions", type=int, default=32, help="the first N usable replies")
    parser.add_argument("--batch-questions", type=int, default=4)
    parser.add_argument("--states", default=",".join(STATES))
    parser.add_argument("--contexts", default=",".join(CONTEXTS))
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "teacher_bias.json")
    args = parser.parse_args(argv)
    try:
        return measure(args, argv)
    except InputError as exc:
        raise SystemExit(f"error: {exc}") from None


def measure(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    import lightning as L
    import torch

    import lopd_lightning
    from compare_runs import src_provenance
    from lopd_lightning.tasks import get_task

    checkpoint, states, contexts, data = check_inputs(args)
    rows = read_replies(args.replies, args.questions)
    if not rows:
        raise InputError(f"--replies: {args.replies} has no single-turn reply whose call closes its arguments with }}}}")
    if "latent_wrong" in contexts and len({row["example_id"] for row in rows}) < 2:
        raise InputError("--questions: latent_wrong needs at least 2 different questions (it takes the next one's experiences)")
    if args.threads:
        torch.set_num_threads(args.threads)
    task = get_task(data["task"], **(data.get("task_options") or {}))
    examples = {ex.id: ex for split in ("train", "val") for ex in task.examples(split)}
    if missing := sorted({row["example_id"] for row in rows} - set(examples)):
        raise InputError(f"--replies: questions {missing[:3]} are not in the run's task {data['task']}")
    result: dict[str, Any] = {
        **run_metadata(seed=args.seed, argv=argv),
        "src_hash": src_provenance(Path(lopd_lightning.__file__).resolve().parents[2])["src_hash"],
        "run": str(args.run), "checkpoint": str(checkpoint), "replies": str(args.replies),
        "questions": [row["example_id"] for row in rows], "states": {},
    }
    for state in states:
        L.seed_everything(args.seed)
        t0 = time.perf_counter()
        module, step = build_state(state, checkpoint)
        comma_ids = comma_token_ids(module.tokenizer)
        retrieved = module.retrieve(task, [examples[row["example_id"]] for row in rows])
        merged: dict[str, dict[str, list[float]]] = {c: {} for c in contexts}
        for i in range(0, len(rows), args.batch_questions):
            part = rows[i : i + args.batch_questions]
            wrong = [retrieved[(j + 1) % len(rows)] for j in range(i, i + len(part))]  # the next question's
            scores = score_batch(module, make_batch(module, task, examples, part, corrupt=False),
                                 make_batch(module, task, examples, part, corrupt=True), contexts,
                                 wrong=wrong, seed=args.seed + i, comma_ids=comma_ids)
            for c in contexts:
                for key, values in scores[c].items():
                    merged[c].setdefault(key, []).extend(values)
            print(f"{state}: {i + len(part)}/{len(rows)} questions ({time.perf_counter() - t0:.0f} s)", flush=True)
        summary: dict[str, Any] = {"checkpoint_step": 0 if state == "start" else step, "bank_size": len(module.bank),
                                   "seconds": time.perf_counter() - t0}
        for c in contexts:
            summary[c] = {key: (max(v) if key == "alignment_max_abs_logp" else bootstrap(v, resamples=args.resamples, seed=args.seed))
                          for key, v in merged[c].items()}
        result["states"][state] = summary
        write_json_atomic(result, args.out)
        del module
    return result


if __name__ == "__main__":
    main()
