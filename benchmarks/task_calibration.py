"""Does experience matter on a task? The start student greedily, without and with its retrieved trajectory.

    python benchmarks/task_calibration.py --task hidden_rules --student runs/hidden_rules/sft_student
        # -> benchmarks/results/task_calibration_hidden_rules.json

The calibration that issue 33 asks for before any RL, on the task's held-out split (the val split: 200
requests for ``hidden_rules``; ``--limit N`` takes the first N):

1. **The bank** is the runs' own: the train split's reference solutions replayed and scored through the
   function ``lopd build-memory --from-references`` uses (``cli.commands._reference_experiences``, the
   module's ``reference_trajectory`` / ``experience_from_trajectory`` hooks; successes only, reward >= 1),
   put in an :class:`~lopd_lightning.memory.ExperienceBank` with the ``--embedder`` (``minilm``, LOPD's
   default) and saved in ``<work-dir>/bank_<hash>``, the hash taken over the experiences, the embedder's
   name and the bank's settings (a second run with the same bank reads it; anything else builds another).
   It is then read back with ``ExperienceBank.load``, as an LOPD run reads its ``bank_path``.
   For ``hidden_rules`` the references must be ``"rules"`` (the default): the successes that show the
   hidden rules.
2. **Retrieval**: top-1 per held-out task by exact cosine over the embedded task texts
   (``memory.module_bank.retrieve_from``, LOPD's and OPSD's retrieval, with k = 1). Held-out tasks are not in
   the bank, so no task can retrieve its own solution. ``same_tool_rate``: how often the retrieved experience
   is of the same tool.
3. **Two greedy answers per held-out task**, by the same weights (the ``--student`` folder that
   ``benchmarks/start_student.py`` wrote, loaded as :class:`~lopd_lightning.modules.LOPDModule` loads a
   student, LoRA on it as in the evidence runs and ``teacher_mode: live``):
   - ``student``: the student as is, through the project's evaluation code
     (``LOPDModule.evaluate_examples``: the rollout code, ``--batch-size`` tasks at once), as
     ``start_student.py`` measures its held-out success;
   - ``text_nearest``: the same model with the retrieved trajectory as text, framed and placed exactly as
     ``benchmarks/privileged_margin.py``'s ``text_nearest`` teacher context and as LOPD frames its
     experiences (``SelfTeacher.encode_text_context``: ``DEFAULT_FRAMING_PREFIX + trace +
     DEFAULT_FRAMING_SUFFIX`` of ``teacher/splice.py``, inserted at the start of the first user message's
     content by ``SelfTeacher.insert_context``), answered by ``lopd_lightning.privilege.teacher_greedy_reply``
     (one task at a time, KV cache, ``--max-new-tokens``).
   ``pairing_check``: the first ``--pairing-check`` tasks are also answered by ``text_nearest``'s code with an
   empty context; how many of those replies equal the student's own says how far the two answers differ by
   the context alone (the batched rollout code and the one-at-a-time loop could, in principle, round
   differently).
4. **Statistics**: success = reward >= 1; ``difference`` = text_nearest_success - student_success, with
   ``difference_ci`` a 95% percentile interval from a paired bootstrap over questions
   (``compare_stats.paired_differences``, the comparison's own: ``--resamples`` draws, seeded by
   ``--seed``; a question's two answers are resampled together).

The JSON (``--out``): ``n_heldout``, ``student_success`` / ``student_solved``, ``text_nearest_success`` /
``text_nearest_solved``, ``difference``, ``difference_ci``, ``same_tool_rate``, ``targets`` and ``met``
(the issue's bar, fixed before calibrating: the student in [0.10, 0.25], a difference >= 0.20 whose
interval excludes 0), ``by_rule_kind`` / ``by_group`` (rule and plain tools) / ``by_tool`` (``n``, both
successes, the difference and the same-tool rate of each), ``bank``, ``pairing_check``, ``per_question`` (id, tool, rule
kind, plain, retrieved id, tool and cosine score, same tool, the context's token count, both rewards,
replies and checker errors), ``settings``, ``timings_s`` and the run's metadata (``common.run_metadata``).

The answers are journalled in ``<work-dir>/journal.jsonl`` (``privileged_margin.Journal``): a run stopped
part-way continues with the same arguments; other settings are refused (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, run_metadata, write_json_atomic  # noqa: E402
from privileged_margin import Journal, file_stamp  # noqa: E402

from lopd_lightning.privilege import reply_outcome, teacher_greedy_reply  # noqa: E402
from compare_stats import paired_differences  # noqa: E402
from start_student import LORA, greedy_batches, task_options  # noqa: E402

#: the issue's bar, fixed before calibrating: the start student's greedy success, and the least difference
TARGETS = {"student_success": [0.10, 0.25], "difference_min": 0.20}


# ---------------------------------------------------------------------------------------- statistics
def solved(reward: float) -> bool:
    return reward >= 1.0


def group_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``n``, both successes, their difference and the same-tool rate of a group of per-question records."""
    n = len(records)
    student = sum(solved(r["student_reward"]) for r in records) / n
    text = sum(solved(r["text_nearest_reward"]) for r in records) / n
    same = [r["same_tool"] for r in records if r["same_tool"] is not None]
    return {"n": n, "student_success": student, "text_nearest_success": text, "difference": text - student,
            "same_tool_rate": sum(same) / len(same) if same else None}


def breakdown(records: list[dict[str, Any]], group_of: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """:func:`group_stats` of the records grouped by ``group_of(record)`` (records whose group is None left out)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        if group_of(record) is not None:
            groups.setdefault(str(group_of(record)), []).append(record)
    return {name: group_stats(group) for name, group in sorted(groups.items())}


def tool_group(record: dict[str, Any]) -> str | None:
    """``"plain_tools"`` or ``"rule_tools"`` (None for a task without plain tools)."""
    return None if record.get("plain") is None else ("plain_tools" if record["plain"] else "rule_tools")


def summarise(records: list[dict[str, Any]], *, resamples: int, seed: int) -> dict[str, Any]:
    """The top-level numbers of the JSON from the per-question records."""
    student = [1.0 if solved(r["student_reward"]) else 0.0 for r in records]
    text = [1.0 if solved(r["text_nearest_reward"]) else 0.0 for r in records]
    paired = paired_differences(dict(enumerate(text)), dict(enumerate(student)), n_boot=resamples, seed=seed)
    difference, ci = paired["mean_difference"], paired["ci"]
    overall = group_stats(records)
    return {
        "n_heldout": len(records),
        "student_success": overall["student_success"], "student_solved": int(sum(student)),
        "text_nearest_success": overall["text_nearest_success"], "text_nearest_solved": int(sum(text)),
        "difference": difference, "difference_ci": ci,
        "same_tool_rate": overall["same_tool_rate"],
        "same_tool_count": sum(bool(r["same_tool"]) for r in records),
        "targets": TARGETS,
        "met": {
            "student_success": TARGETS["student_success"][0] <= overall["student_success"] <= TARGETS["student_success"][1],
            "difference": difference >= TARGETS["difference_min"],
            "difference_ci_excludes_0": paired["excludes_zero"],
        },
        "by_rule_kind": breakdown(records, lambda r: r.get("rule_kind")),
        "by_group": breakdown(records, tool_group),
        "by_tool": breakdown(records, lambda r: r.get("tool")),
    }


# ---------------------------------------------------------------------------------------- the bank
def bank_key(experiences: list, embedder_name: str, settings: dict[str, Any]) -> str:
    """The first 16 hex digits of a SHA-256 over the experiences, the embedder's name and the bank settings."""
    payload = {"experiences": [e.to_dict() for e in experiences], "embedder": embedder_name, "settings": settings}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def train_bank(module, task, work_dir: Path) -> dict[str, Any]:
    """Give ``module`` the bank of the train split's successful reference trajectories, built as
    ``lopd build-memory --from-references`` builds it, or read from ``work_dir`` when the same bank is there.

    Returns:
        ``{"size", "n_train", "embedder", "index" (``"flat"``: exact cosine), "hash", "folder", "cached", "seconds"}``.
    """
    from lopd_lightning.cli.commands import _reference_experiences
    from lopd_lightning.memory import ExperienceBank

    start = time.perf_counter()
    train = task.examples("train")
    experiences = _reference_experiences(module, task, train, 1.0)  # replayed, scored, failures left out
    empty = module.bank  # the module's own empty bank: its embedder and settings (LOPD's, from its options)
    key = bank_key(experiences, empty.embedder_name, empty.settings())
    folder = work_dir / f"bank_{key}"
    cached = (folder / "meta.json").is_file()
    if not cached:
        fresh = ExperienceBank(empty.embedder, **empty.settings())
        fresh.add(experiences)
        fresh.save(folder)
    module.bank = ExperienceBank.load(folder, empty.embedder, **empty.settings())  # as build_bank loads bank_path
    return {"size": len(module.bank), "n_train": len(train), "embedder": empty.embedder_name,
            "index": module.bank.index_kind, "hash": key, "folder": relative(folder), "cached": cached,
            "seconds": round(time.perf_counter() - start, 1)}


def retrieve_top1(module, examples: list, *, batch_size: int = 64) -> list[tuple[Any, float | None]]:
    """Each example's top-1 experience and its cosine score ((None, None) when none was found):
    ``memory.module_bank.retrieve_from`` with k = 1, what ``LOPDModule.retrieve`` runs with J = 1."""
    from lopd_lightning.memory.module_bank import retrieve_from

    out: list[tuple[Any, float | None]] = []
    for i in range(0, len(examples), batch_size):
        result = retrieve_from(module.bank, examples[i : i + batch_size], 1)
        for row, found in enumerate(result.experiences):
            out.append((found[0], float(result.scores[row, 0])) if found else (None, None))
    return out


# ---------------------------------------------------------------------------------------- the answers
def build_module(student: str, args: argparse.Namespace):
    """The student as an LOPD run loads it (LoRA as in the evidence runs, the live self-teacher, J = 1)."""
    from lopd_lightning.modules import LOPDModule

    module = LOPDModule(student, lora=LORA, group_size=1, max_new_tokens=args.max_new_tokens, num_latents=1,
                        num_experiences=1, composer_depth=1, embedder=args.embedder, teacher_mode="live",
                        seed=args.seed)
    module.eval()
    return module


def answer_student(module, task, examples: list, journal: Journal, *, batch_size: int) -> None:
    """Greedy answers of the student as is (the rollout code, batched: ``start_student.greedy_batches``),
    journalled with each reply and the checker's error."""
    done = {line["id"] for line in journal.lines if line.get("who") == "student"}
    todo = [example for example in examples if example.id not in done]
    start, answered = time.perf_counter(), 0
    for chunk, batch in greedy_batches(module, task, todo, batch_size=batch_size):
        for example, reward, messages, meta in zip(chunk, batch.rewards.tolist(), batch.messages, batch.metadata,
                                                   strict=True):
            reply = next((m["content"] for m in reversed(messages) if m["role"] == "assistant"), "")
            journal.append({"kind": "greedy", "who": "student", "id": example.id, "reward": float(reward),
                            "reply": reply, "error": (meta.get("info") or {}).get("error")})
        answered += len(chunk)
        print(f"student: {answered}/{len(todo)} ({time.perf_counter() - start:.0f} s)", flush=True)


def answer_with_context(module, task, examples: list, retrieved: list, journal: Journal, *, max_new_tokens: int) -> None:
    """Greedy answers of the same model with the retrieved trajectory as framed text, journalled."""
    done = {line["id"] for line in journal.lines if line.get("who") == "text_nearest"}
    start = time.perf_counter()
    for k, (example, (experience, _)) in enumerate(zip(examples, retrieved, strict=True)):
        if example.id in done:
            continue
        ids = module.teacher.encode_text_context([experience.trace if experience is not None else None])[0]
        reply = teacher_greedy_reply(module, task, example, context_ids=ids, max_new_tokens=max_new_tokens)
        reward, error = reply_outcome(task, example, reply)
        journal.append({"kind": "greedy", "who": "text_nearest", "id": example.id, "reward": reward, "reply": reply,
                        "error": error, "context_tokens": len(ids)})
        if (k + 1) % 10 == 0 or k + 1 == len(examples):
            print(f"text_nearest: {k + 1}/{len(examples)} ({time.perf_counter() - start:.0f} s)", flush=True)


def pairing_check(module, task, examples: list, journal: Journal, *, max_new_tokens: int) -> dict[str, Any]:
    """The first ``examples`` answered by ``text_nearest``'s code with an empty context: how many replies (and
    rewards) equal the student's own, i.e. how far the two answers differ by the context alone."""
    done = {line["id"]: line for line in journal.lines if line.get("who") == "no_context"}
    for example in examples:
        if example.id not in done:
            reply = teacher_greedy_reply(module, task, example, context_ids=[], max_new_tokens=max_new_tokens)
            reward, error = reply_outcome(task, example, reply)
            done[example.id] = {"kind": "greedy", "who": "no_context", "id": example.id, "reward": reward,
                                "reply": reply, "error": error}
            journal.append(done[example.id])
    student = {line["id"]: line for line in journal.lines if line.get("who") == "student"}
    ids = [example.id for example in examples]
    return {"n": len(ids), "same_reply": sum(done[i]["reply"] == student[i]["reply"] for i in ids),
            "same_reward": sum(done[i]["reward"] == student[i]["reward"] for i in ids),
            "differing_ids": [i for i in ids if done[i]["reply"] != student[i]["reply"]]}


def question_fields(example) -> dict[str, Any]:
    """A question's tool, rule kind and plainness from its data (None where the task has none)."""
    data = example.data if isinstance(example.data, dict) else {}
    rule = data.get("rule") if isinstance(data.get("rule"), dict) else {}
    return {"tool": data.get("tool"), "rule_kind": rule.get("kind"), "plain": data.get("plain")}


def per_question(examples: list, retrieved: list, train_tools: dict[str, Any], journal: Journal) -> list[dict[str, Any]]:
    """The records of the JSON's ``per_question``, in held-out order."""
    answers = {(line["who"], line["id"]): line for line in journal.lines if line["kind"] == "greedy"}
    records = []
    for example, (experience, score) in zip(examples, retrieved, strict=True):
        fields = question_fields(example)
        retrieved_tool = train_tools.get(experience.task_id) if experience is not None else None
        student, text = answers[("student", example.id)], answers[("text_nearest", example.id)]
        same = None if fields["tool"] is None or experience is None else retrieved_tool == fields["tool"]
        records.append({
            "id": example.id, **fields,
            "retrieved_id": experience.task_id if experience is not None else None, "retrieved_tool": retrieved_tool,
            "retrieval_score": score, "same_tool": same, "context_tokens": text.get("context_tokens"),
            "student_reward": student["reward"], "text_nearest_reward": text["reward"],
            "student_reply": student.get("reply"), "text_nearest_reply": text.get("reply"),
            "student_error": student.get("error"), "text_nearest_error": text.get("error"),
        })
    return records


# ---------------------------------------------------------------------------------------- main
def relative(path: Path) -> str:
    """``path`` relative to the repository when inside it (as the other benchmarks record paths)."""
    return str(path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="hidden_rules")
    parser.add_argument("--task-options", type=task_options, default={},
                        help="JSON object of the task's constructor options (its references must give the successes)")
    parser.add_argument("--student", default=None, help="the folder start_student.py wrote (default runs/<task>/sft_student), "
                        "or a packaged model name (smollm2-135m-instruct, tiny)")
    parser.add_argument("--embedder", default="minilm", help="the bank's embedder (LOPD's default minilm; hashing for tests)")
    parser.add_argument("--limit", type=int, default=None, help="only the first N held-out tasks")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="greedy reply limit (start_student.py's)")
    parser.add_argument("--batch-size", type=int, default=16, help="tasks the student answers at once (no context)")
    parser.add_argument("--pairing-check", type=int, default=16, help="the first N held-out tasks also answered by "
                        "text_nearest's code with no context, compared with the student's replies (0: none)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap draws of the difference's interval")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default benchmarks/results/task_calibration_<task>.json")
    parser.add_argument("--work-dir", type=Path, default=None, help="the bank and the journal (default "
                        "runs/<task>/task_calibration)")
    parser.add_argument("--fresh", action="store_true", help="discard the journal's answers (the bank is kept)")
    args = parser.parse_args(argv)
    if args.task_options.get("references", "rules") != "rules":
        parser.error("--task-options: the bank holds the successes of the train split's references; keep "
                     "\"references\": \"rules\" (the format-only references are the start student's SFT data)")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    args.student = args.student or str(REPO_ROOT / "runs" / args.task / "sft_student")
    args.out = args.out or REPO_ROOT / "benchmarks" / "results" / f"task_calibration_{args.task}.json"
    args.work_dir = args.work_dir or REPO_ROOT / "runs" / args.task / "task_calibration"
    if args.student not in ("tiny", "smollm2-135m-instruct") and not (Path(args.student) / "config.json").is_file():
        parser.error(f"--student {args.student}: no model folder; make it with benchmarks/start_student.py")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    import lightning as L
    import torch

    from compare_runs import src_provenance
    from lopd_lightning.tasks import get_task

    if args.threads:
        torch.set_num_threads(args.threads)
    L.seed_everything(args.seed)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    task = get_task(args.task, **args.task_options)
    if task.multi_turn:
        raise SystemExit(f"error: {args.task} is multi-turn; the calibration answers single-turn tasks (one reply)")
    heldout = task.examples("val")[: args.limit]
    module = build_module(args.student, args)
    timings["setup_s"] = time.perf_counter() - t0
    bank = train_bank(module, task, args.work_dir)
    timings["bank_s"] = bank["seconds"]

    t0 = time.perf_counter()
    retrieved = retrieve_top1(module, heldout)
    timings["retrieval_s"] = time.perf_counter() - t0
    student_stamp = file_stamp(Path(args.student)) if Path(args.student).exists() else args.student
    key = {"src_hash": src_provenance()["src_hash"], "task": args.task, "task_options": args.task_options,
           "student": student_stamp, "questions": [e.id for e in heldout], "bank": bank["hash"],
           "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size, "seed": args.seed}
    journal = Journal(args.work_dir, key, fresh=args.fresh)

    t0 = time.perf_counter()
    answer_student(module, task, heldout, journal, batch_size=args.batch_size)
    timings["student_greedy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    answer_with_context(module, task, heldout, retrieved, journal, max_new_tokens=args.max_new_tokens)
    timings["text_nearest_greedy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    pairing = pairing_check(module, task, heldout[: args.pairing_check], journal, max_new_tokens=args.max_new_tokens)
    timings["pairing_check_s"] = time.perf_counter() - t0

    train_tools = {e.id: question_fields(e)["tool"] for e in task.examples("train")}
    records = per_question(heldout, retrieved, train_tools, journal)
    results: dict[str, Any] = {
        "benchmark": "task_calibration", "task": args.task, "task_options": args.task_options,
        "student": relative(Path(args.student)) if Path(args.student).exists() else args.student,
        "limit": args.limit,
        **summarise(records, resamples=args.resamples, seed=args.seed),
        "bank": bank,
        "pairing_check": pairing,
        "settings": {"decoding": "greedy", "max_new_tokens": args.max_new_tokens, "batch_size": args.batch_size,
                     "seed": args.seed, "resamples": args.resamples, "embedder": args.embedder, "retrieved": 1,
                     "success": "reward >= 1", "lora": LORA, "teacher_mode": "live",
                     "framing_prefix": module.teacher.framing_prefix, "framing_suffix": module.teacher.framing_suffix,
                     "contexts_cut": module.teacher.contexts_cut,
                     "student_answers": "LOPDModule.evaluate_examples (the rollout code, batched)",
                     "text_nearest_answers": "privileged_margin.teacher_greedy_reply (context spliced by SelfTeacher)"},
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "per_question": records,
        **run_metadata(seed=args.seed, argv=argv),
    }
    write_json_atomic(results, args.out)
    ci = results["difference_ci"]
    print(f"{args.task}: student {results['student_solved']}/{len(heldout)}, text_nearest "
          f"{results['text_nearest_solved']}/{len(heldout)}, difference {results['difference']:+.3f} "
          f"[{ci[0]:+.3f}, {ci[1]:+.3f}], same tool {results['same_tool_rate']} -> {args.out}")
    return results


if __name__ == "__main__":
    main()
