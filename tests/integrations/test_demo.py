"""``topkd demo``: KD against cross-entropy on the demo's own numbers (a shorter run than the
default, the same code), the files ``--out`` saves, and the README's commands that load them,
run as written."""

import io
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import ROOT  # noqa: E402

from topkd.cli import main  # noqa: E402
from topkd.hf import demo  # noqa: E402

STEPS = 100  # per student (the default demo: 400)
TEACHER_STEPS = 150  # (the default demo: 240; 60 at 100 student steps is too few to teach)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The demo with ``--steps 100 --teacher-steps 150 --out DIR``: its result, its printed
    table, DIR."""
    out = tmp_path_factory.mktemp("demo") / "demo"
    printed = io.StringIO()
    threads = torch.get_num_threads()
    result = demo.run_demo(steps=STEPS, teacher_steps=TEACHER_STEPS, out=str(out),
                           progress=False, file=printed)
    assert torch.get_num_threads() == threads  # restored
    return result, printed.getvalue(), out


def test_one_thread_by_default(ran):
    """Tiny models gain little from threads and lose a lot on a shared machine's cores."""
    result, _, _ = ran
    assert result.threads == demo.THREADS == 1


def test_kd_halves_the_kl_and_beats_cross_entropy(ran):
    result, _, _ = ran
    ce, online, stored = result.runs["ce"], result.runs["online"], result.runs["store"]
    for run in (ce, online, stored):  # one untrained student for all three
        assert (run.kl_before, run.ce_before) == (ce.kl_before, ce.ce_before)
    for run in (online, stored):
        assert run.kl_after <= 0.5 * run.kl_before, (run.kl_before, run.kl_after)
        assert run.kl_after < ce.kl_after, (run.kl_after, ce.kl_after)
    # the store keeps the teacher's rows (the compact codec: log-probs within 1/64 nat): the
    # same training
    assert stored.kl_after == pytest.approx(online.kl_after, rel=1e-2)
    # the teacher learned the language: far below uniform, and below every student
    assert result.teacher_ce < 0.5 * torch.tensor(float(demo.VOCAB_SIZE)).log().item()
    assert result.teacher_ce < min(run.ce_after for run in result.runs.values())
    assert result.store_tokens == STEPS * demo.STUDENT_BATCH * demo.SEQ_LEN


def test_table_shows_the_numbers(ran):
    result, printed, out = ran
    for name, run in result.runs.items():
        row = next(line for line in printed.splitlines() if line.startswith(demo.RUNS[name][0]))
        assert f"{run.kl_before:.3f}" in row and f"{run.kl_after:.3f}" in row
        assert f"{run.ce_before:.3f}" in row and f"{run.ce_after:.3f}" in row
    assert f"held-out CE {result.teacher_ce:.3f}" in printed
    assert f"Saved in {out}" in printed


def test_saved_files(ran):
    result, _, out = ran
    from transformers import AutoModelForCausalLM

    from topkd.store import TeacherStore

    lines = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [row["id"] for row in lines] == list(range(demo.TRAIN_SEQUENCES))
    corpus = torch.tensor([row["input_ids"] for row in lines])
    held_out = torch.tensor([json.loads(line)["input_ids"] for line in
                             (out / "heldout.jsonl").read_text().splitlines()])
    assert held_out.shape == (demo.HELD_OUT_SEQUENCES, demo.SEQ_LEN)
    everything = demo.Language(demo.VOCAB_SIZE, 0).sample(
        demo.TRAIN_SEQUENCES + demo.HELD_OUT_SEQUENCES, demo.SEQ_LEN, seed=0)
    assert torch.equal(torch.cat([corpus, held_out]), everything)

    teacher = AutoModelForCausalLM.from_pretrained(out / "teacher")
    assert demo._cross_entropy(teacher, held_out) == pytest.approx(result.teacher_ce, rel=1e-5)
    student = AutoModelForCausalLM.from_pretrained(out / "student")
    untrained = demo._model(demo.STUDENT, 1)
    fresh = untrained.state_dict()
    assert student.state_dict().keys() == fresh.keys()
    for name, saved in student.state_dict().items():
        assert torch.equal(saved, fresh[name]), name

    store = TeacherStore(out / "store")
    assert len(store) == STEPS * demo.STUDENT_BATCH
    assert torch.equal(store.tokens(7).long(), corpus[7])


def _readme_commands() -> tuple[list[str], list[list[str]]]:
    """The README's Python blocks and ``topkd`` command lines that use the demo's files."""
    text = open(os.path.join(ROOT, "README.md")).read()
    python, commands = [], []
    for language, body in re.findall(r"```(\w+)\n(.*?)```", text, re.S):
        if "demo/" not in body:
            continue
        if language == "python":
            python.append(body)
            continue
        for line in body.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["topkd"] and any("demo/" in w or w == "store" for w in words):
                commands.append(words[1:])
    return python, commands


README_SEQUENCES = 1024  # of the demo's 4,096 training sequences: 20 steps of 32 use 640


def test_readme_examples_run_as_written(ran, tmp_path, monkeypatch, capsys):
    """Each README example that loads ``demo/`` runs in a directory where ``demo`` is what
    ``topkd demo --out demo`` saved, its ``train.jsonl`` cut to its first sequences (the
    teacher store is built over all of them; the examples train 20 steps). (``torchrun``'s
    line is test_distill.py's torchrun test.)"""
    _, _, out = ran
    python, commands = _readme_commands()
    assert len(python) == 1 and len(commands) >= 5, (python, commands)
    demo_dir = tmp_path / "demo"
    demo_dir.mkdir()
    for entry in out.iterdir():
        if entry.name != "train.jsonl":
            (demo_dir / entry.name).symlink_to(entry)
    lines = (out / "train.jsonl").read_text().splitlines(keepends=True)
    (demo_dir / "train.jsonl").write_text("".join(lines[:README_SEQUENCES]))
    monkeypatch.chdir(tmp_path)
    exec(compile(python[0], "README.md", "exec"), {})
    assert "eval_kl" in capsys.readouterr().out
    for words in commands:
        assert main(words) == 0, words
    for directory in ("out", "distilled", "distilled-offline", "store"):
        assert (tmp_path / directory).is_dir(), directory
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "distilled-offline")


def test_language():
    language = demo.Language(demo.VOCAB_SIZE, 3)
    a = language.sample(5, 40, seed=1)
    assert a.shape == (5, 40) and a.dtype == torch.int64
    assert torch.equal(a, demo.Language(demo.VOCAB_SIZE, 3).sample(5, 40, seed=1))
    assert int(a.min()) >= 1 and int(a.max()) < demo.VOCAB_SIZE
    assert (a[:, 0] == demo.Language.BOS).all() and (a == demo.Language.STOP).any()
    assert not torch.equal(a, language.sample(5, 40, seed=2))
    with pytest.raises(ValueError, match="vocab_size must be at least 131 .* got 100"):
        demo.Language(100)


@pytest.mark.parametrize("option", ["--steps", "--teacher-steps"])
def test_bad_steps(option, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["demo", option, "0"])
    assert exit.value.code == 2
    assert f"{option}: must be >= 1, got 0" in capsys.readouterr().err


def _demo_subprocess(tmp_path, *args, pythonpath=()):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), ROOT])}
    return subprocess.run([sys.executable, "-m", "topkd.cli", "demo", "--steps", "1",
                           "--teacher-steps", "1", "--quiet", *args], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


def test_what_the_demo_needs_is_checked_before_any_work(tmp_path, capsys):
    """Without accelerate (hidden the way a missing package is, in a process of its own:
    transformers' Trainer imports, its TrainingArguments refuse), the demo stops at once,
    saying what to install, with nothing trained or saved; an --out that is a file is refused
    as cleanly."""
    block = tmp_path / "no-accelerate"
    block.mkdir()
    (block / "sitecustomize.py").write_text("import sys\nsys.modules['accelerate'] = None\n")
    out = tmp_path / "demo"
    result = _demo_subprocess(tmp_path, "--out", str(out), pythonpath=[block])
    assert result.returncode == 1, result.stderr[-2000:]
    assert "topkd demo: error:" in result.stderr and "accelerate" in result.stderr
    assert "pip install 'topkd[hf]'" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "teacher").exists()

    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["demo", "--steps", "1", "--teacher-steps", "1", "--quiet",
                 "--out", str(afile)]) == 1
    err = capsys.readouterr().err
    assert f"--out {str(afile)!r} exists and is not a directory" in err
    assert "Traceback" not in err


def _training_flags(words: list[str]) -> dict:
    """The options of a ``distill`` command line that decide what is trained."""
    flags = {}
    for name in ("--k", "--divergence", "--beta", "--max-steps", "--lr", "--batch-size"):
        if name in words:
            flags[name] = words[words.index(name) + 1]
    return flags


def test_readme_torchrun_example_trains_as_the_single_process_one():
    """The README's torchrun line has the single-process example's settings (its global batch
    too: --batch-size is per process), so it learns as that one does."""
    text = open(os.path.join(ROOT, "README.md")).read()
    lines = [shlex.split(line, comments=True) for block in re.findall(r"```bash\n(.*?)```",
                                                                      text, re.S)
             for line in block.replace("\\\n", " ").splitlines()]
    single = next(w for w in lines if w[:2] == ["topkd", "distill"] and "--teacher" in w)
    ddp = next(w for w in lines if w[:1] == ["torchrun"] and "distill" in w)
    processes = int(ddp[ddp.index("--nproc-per-node") + 1])
    want, got = _training_flags(single), _training_flags(ddp)
    assert int(got.pop("--batch-size")) * processes == int(want.pop("--batch-size"))
    assert got == want


def test_readme_install_takes_the_cpu_torch_first():
    """On a machine without a GPU a plain `pip install -e .` pulls CUDA wheels of several GB:
    the README's install says how to get the CPU build first."""
    text = open(os.path.join(ROOT, "README.md")).read()
    install = text.split("## Install", 1)[1]
    block = re.search(r"```bash\n(.*?)```", install, re.S).group(1)
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    commands = [c for c in commands if c]
    cpu = ["pip", "install", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert commands[0] == cpu, commands
    assert all(c[:3] == ["pip", "install", "-e"] for c in commands[1:]), commands
