"""benchmarks/teacher_bias.py: where the self-teacher disagrees with the student on the student's own replies.

A tiny random LOPD module on a small hidden_rules, its checkpoint written with a perturbed composer and student:
the teacher without context equals the student (the alignment check), the student's log-ratio of the
schema-copying reply equals a plain forward's, and the latents do change the teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark, quiet_trainer

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TASK = {"n_train": 24, "n_heldout": 4}


@pytest.fixture(scope="module")
def bias():
    return load_benchmark("teacher_bias")


def test_the_corrupted_reply_adds_the_schema_required_list_inside_arguments(bias):
    reply = '<tool_call>[{"name": "f", "arguments": {"a": "x", "b": 3}}]</tool_call>'
    system = 'tools <tools>[{"name": "f", "parameters": {"required": ["a", "b"]}}]</tools>'
    assert bias.schema_required(system, reply) == ["a", "b"]
    assert bias.schema_required("no tools here", reply) == []
    corrupt = bias.corrupt_reply(reply, ["a", "b"])
    assert corrupt == '<tool_call>[{"name": "f", "arguments": {"a": "x", "b": 3, "required": ["a", "b"]}}]</tool_call>'
    assert json.loads(corrupt[len("<tool_call>"):-len("</tool_call>")])[0]["arguments"]["required"] == ["a", "b"]
    assert bias.corrupt_reply("<tool_call>[]</tool_call>", ["a"]) is None
    # the closing token: the first piece holding "}" once "arguments" has been written
    assert bias.close_index(['{"', 'name', '": "f", "', 'arguments', '": {"a": 1', '}}', ']']) == 5
    assert bias.close_index(['{"a": 1', '}}']) is None


def test_the_bootstrap_covers_the_mean_and_counts_positive_values(bias):
    out = bias.bootstrap([1.0, -1.0, 2.0, 2.0], resamples=500, seed=0)
    assert out["mean"] == 1.0 and out["n"] == 4 and out["positive_fraction"] == 0.75
    assert out["ci"][0] <= 1.0 <= out["ci"][1]
    assert bias.bootstrap([], resamples=10, seed=0) == {"mean": None, "ci": None, "n": 0}


def tiny_run(tmp_path: Path) -> tuple[Path, Path]:
    """A run folder (config.yaml, checkpoints/last.ckpt with a moved student and composer) and a generations
    file of the held-out reference replies in the runs' format."""
    from lopd_lightning.cli import main as lopd
    from lopd_lightning.modules import LOPDModule
    from lopd_lightning.tasks import get_task

    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("common.yaml", "lopd.yaml"):
        text = (ROOT / "configs" / "experience_tiny" / name).read_text()
        (configs / name).write_text(text.replace("runs/experience_tiny", str(tmp_path / "work")))
    assert lopd(["build-memory", "-c", str(configs / "common.yaml"), "-c", str(configs / "lopd.yaml"),
                 "--model.init_args.composer_path=null", "--from-references"]) == 0
    torch.manual_seed(0)
    module = LOPDModule("tiny", lora=LORA, num_latents=4, num_experiences=2, composer_depth=2, max_experience_tokens=64,
                        embedder="hashing", bank_path=str(tmp_path / "work" / "bank"), warm_start_steps=0,
                        distill_top_k=8, seed=0)
    with torch.no_grad():  # a trained run's state: the student's LoRA and the composer moved from the start
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    run = tmp_path / "run"
    trainer = quiet_trainer(tmp_path)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(run / "checkpoints" / "last.ckpt")
    (run / "config.yaml").write_text(json.dumps({"data": {"init_args": {"task": "hidden_rules", "task_options": TASK}}}))
    task = get_task("hidden_rules", **TASK)
    lines = []
    for ex in task.examples("val"):
        messages, reward = module.reference_trajectory(task, ex)
        lines.append(json.dumps({"example_id": ex.id, "reward": reward, "messages": messages}))
    replies = run / "val_step_0.jsonl"
    replies.write_text("\n".join(lines) + "\n")
    return run, replies


def naive_student_reply_logp(module, task, row) -> float:
    """The student's log-likelihood of a conversation's assistant tokens, from a plain forward."""
    from lopd_lightning.rollout import batch_from_conversations

    ex = task.examples("val")[int(row["example_id"].split("/")[-1])]
    batch = batch_from_conversations(module.tokenizer, [row["messages"]], rewards=[1.0], group_ids=[0],
                                     example_ids=[ex.id], tools=[task.tools(ex)])
    with torch.no_grad(), module.student_context():
        logps = module.backbone(input_ids=batch.input_ids).logits[0, :-1].log_softmax(-1)
    targets, mask = batch.input_ids[0, 1:], batch.assistant_mask[0, 1:].bool()
    return float(logps.gather(-1, targets[:, None])[:, 0][mask].sum())


def test_the_teacher_without_context_is_the_student_and_the_latents_move_it(bias, tmp_path):
    from lopd_lightning.tasks import get_task

    run, replies = tiny_run(tmp_path)
    out = tmp_path / "bias.json"
    data = bias.main(["--run", str(run), "--replies", str(replies), "--questions", "3", "--batch-questions", "2",
                      "--resamples", "100", "--out", str(out)])
    assert json.loads(out.read_text())["states"].keys() == {"start", "end", "end_composer"}
    assert len(data["questions"]) == 3 and data["src_hash"]
    for state, summary in data["states"].items():
        none = summary["none"]
        assert none["alignment_max_abs_logp"] < 1e-4, state
        for key in ("logp_delta", "reverse_kl", "close_logp_delta", "required_logratio_delta"):
            assert abs(none[key]["mean"]) < 1e-4 and none[key]["n"] == 3, (state, key)
        # the latents change the teacher, and another question's experiences change it otherwise (a tiny random
        # model's outputs are near uniform: the changes are small, not zero)
        assert summary["latent"]["reverse_kl"]["mean"] > 0
        assert summary["latent"]["logp_delta"]["mean"] != summary["latent_wrong"]["logp_delta"]["mean"]
        assert summary["latent"]["required_logratio_student"] == summary["none"]["required_logratio_student"]
    # the end state's student is the checkpoint's; the end_composer state keeps the start student
    start, end, mixed = (data["states"][s] for s in ("start", "end", "end_composer"))
    assert end["none"]["required_logratio_student"]["mean"] != pytest.approx(start["none"]["required_logratio_student"]["mean"])
    assert mixed["none"]["required_logratio_student"]["mean"] == pytest.approx(start["none"]["required_logratio_student"]["mean"])
    assert mixed["latent"]["reverse_kl"]["mean"] != pytest.approx(start["latent"]["reverse_kl"]["mean"])
    # the student's log-ratio against a plain forward of the start student
    task = get_task("hidden_rules", **TASK)
    module, _ = bias.build_state(run, "start", run / "checkpoints" / "last.ckpt")
    rows = bias.read_replies(replies, 3)
    naive = []
    for row in rows:
        system, user, reply = (m["content"] for m in row["messages"])
        corrupt = dict(row, messages=[*row["messages"][:2], {"role": "assistant", "content": bias.corrupt_reply(
            reply, bias.schema_required(system, reply))}])
        naive.append(naive_student_reply_logp(module, task, corrupt) - naive_student_reply_logp(module, task, row))
    assert start["none"]["required_logratio_student"]["mean"] == pytest.approx(sum(naive) / 3, abs=1e-4)


def test_a_missing_checkpoint_or_an_unknown_context_is_one_line(bias, tmp_path, capsys):
    replies = tmp_path / "r.jsonl"
    replies.write_text("")
    with pytest.raises(SystemExit, match="--checkpoint: no file"):
        bias.main(["--run", str(tmp_path), "--replies", str(replies)])
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    with pytest.raises(SystemExit, match="--contexts: unknown latnet; known: none, latent"):
        bias.main(["--run", str(tmp_path), "--replies", str(replies), "--contexts", "latnet"])
