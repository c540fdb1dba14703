"""``topkd distill``: tiny Llama teacher and student saved with a word-level tokenizer (no
downloads); online and offline (a store) runs, torchrun with 2 gloo ranks against one process,
a run killed with SIGKILL and resumed against an uninterrupted one, and bad arguments."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import helpers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import topkd  # noqa: E402
from topkd.cli import main  # noqa: E402
from topkd.hf.distill import SETTINGS_FILE, last_checkpoint  # noqa: E402
from topkd.store import build_store  # noqa: E402

WORDS = [f"w{i}" for i in range(60)]
ROOT = helpers.ROOT
VOCAB = 64  # the models' rows; the tokenizer has 62 tokens


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _model(seed, scale=1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def _texts(seed, n):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 20, (n,), generator=g).tolist()
    return [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (m,), generator=g))
            for m in lengths]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Teacher and student directories (one tokenizer), train / eval JSON Lines."""
    root = tmp_path_factory.mktemp("distill")
    tokenizer = _tokenizer()
    for name, model in (("teacher", _model(1, scale=6.0)), ("student", _model(2))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"text": t} for t in _texts(0, 24)] + [{"text": "w1"}, {"text": ""}]  # skipped
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                             for t in _texts(1, 8)))
    return root


@pytest.fixture
def one_thread():
    """The in-process runs use one thread, as the subprocesses (OMP_NUM_THREADS=1) do: the
    same numbers, and no oversubscribed cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOPKD_IMPL": "eager",
            "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _args(setup, out, *extra, teacher=True):
    base = ["distill", "--student", str(setup / "student"), "--data",
            str(setup / "train.jsonl"), "--out", str(out), "--no-progress"]
    return base + (["--teacher", str(setup / "teacher")] if teacher else []) + list(extra)


def _run(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _weights(directory):
    return load_file(os.path.join(directory, "model.safetensors"))


def _max_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _kl_to_teacher(teacher_dir, student, texts):
    """KL(teacher || student) per token over ``texts`` (full vocabulary, float64)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            t = teacher(input_ids=ids).logits[0, :-1, :len(tokenizer)].double().log_softmax(-1)
            s = student(input_ids=ids).logits[0, :-1, :len(tokenizer)].double().log_softmax(-1)
            total += float((t.exp() * (t - s)).sum())
            count += ids.shape[1] - 1
    return total / count


def _logged_kd(out):
    with open(os.path.join(last_checkpoint(str(out)), "trainer_state.json")) as f:
        return [entry["kd"] for entry in json.load(f)["log_history"] if "kd" in entry]


def test_online(setup, tmp_path, capsys, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    code, stdout, _ = _run(_args(setup, out, "--eval-data", str(setup / "eval.jsonl"),
                                 "--max-steps", "24", "--batch-size", "4", "--lr", "1e-2",
                                 "--k", "16", "--logging-steps", "4", "--save-steps", "10"),
                           capsys)
    assert code == 0
    assert "trained 24 steps" in stdout and "over 24 samples" in stdout
    assert "skipped 2 samples shorter than 2 tokens" in stdout
    assert f"student saved to {out}" in stdout
    before, after = (float(x) for x in stdout.split("KL(teacher || student) ")[1]
                     .split(",")[0].split(" -> "))
    assert after < 0.8 * before

    student = AutoModelForCausalLM.from_pretrained(out).eval()
    assert len(AutoTokenizer.from_pretrained(out)) == len(WORDS) + 2
    initial = AutoModelForCausalLM.from_pretrained(setup / "student").eval()
    texts = [json.loads(line)["text"] for line in open(setup / "eval.jsonl")]
    kl_before = _kl_to_teacher(setup / "teacher", initial, texts)
    kl_after = _kl_to_teacher(setup / "teacher", student, texts)
    assert kl_after < 0.8 * kl_before
    assert kl_before == pytest.approx(before, rel=1e-3)  # the run's own evaluation agrees
    kd = _logged_kd(out)
    assert len(kd) == 6 and kd[-1] < kd[0]
    assert (out / SETTINGS_FILE).exists()
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == [
        "checkpoint-20", "checkpoint-24"]  # every 10 steps and at the end; the newest 2 kept


def test_offline_store_parquet(setup, tmp_path, capsys, monkeypatch, one_thread):
    """A store built from the same Parquet file (its own id column); the teacher model is not
    loaded; the store's max_length is the default."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = _texts(2, 12)
    data = tmp_path / "train.parquet"
    pq.write_table(pa.table({"uid": [f"s{i}" for i in range(12)], "text": texts}), data)
    store = tmp_path / "store"
    build_store(setup / "teacher", data, store, k=8, id_field="uid", max_length=10,
                progress=False)

    from transformers import AutoModelForCausalLM

    loaded = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        loaded.append(os.path.basename(os.fspath(path)))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    out = tmp_path / "out"
    argv = ["distill", "--store", str(store), "--student", str(setup / "student"), "--data",
            str(data), "--id-field", "uid", "--out", str(out), "--max-steps", "12",
            "--batch-size", "4", "--lr", "1e-2", "--logging-steps", "3", "--no-progress"]
    code, stdout, _ = _run(argv, capsys)
    assert code == 0, stdout
    assert loaded == ["student"]
    assert "trained 12 steps" in stdout
    with open(out / SETTINGS_FILE) as f:
        assert json.load(f)["max_length"] == 10
    kd = _logged_kd(out)
    assert len(kd) == 4 and kd[-1] < kd[0]
    assert _max_diff(_weights(out), _weights(setup / "student")) > 1e-3
    AutoModelForCausalLM.from_pretrained(out)

    # the same data cut at another length does not match the store's tokens
    code, _, err = _run(argv[:-1] + ["--max-length", "12", "--out", str(tmp_path / "o2")],
                        capsys)
    assert code == 1 and "max_length=12 but the store" in err and "max_length=10" in err
    # data the store was not built from: the missing id is named
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"uid": "s3", "text": texts[3]}) + "\n" +
                     json.dumps({"uid": "nope", "text": texts[4]}) + "\n")
    code, _, err = _run(["distill", "--store", str(store), "--student", str(setup / "student"),
                         "--data", str(other), "--id-field", "uid", "--out",
                         str(tmp_path / "o3"), "--no-progress"], capsys)
    assert code == 1 and "sample id 'nope' is not in the teacher store" in err


def test_torchrun_two_ranks(setup, tmp_path, capsys, one_thread):
    """2 gloo ranks of batch 2 end where one process of batch 4 ends (DDP averages the ranks'
    gradients; the loss is normalized by the global token count)."""
    out = tmp_path / "ddp"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "topkd.cli",
               *_args(setup, out, "--max-steps", "6", "--batch-size", "2", "--lr", "1e-3",
                      "--save-steps", "3")]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("trained 6 steps (1.00 epochs") == 1  # rank 0 prints
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)
    with open(out / SETTINGS_FILE) as f:
        assert json.load(f)["world_size"] == 2

    single = tmp_path / "single"
    code, _, _ = _run(_args(setup, single, "--max-steps", "6", "--batch-size", "4", "--lr",
                            "1e-3", "--save-steps", "3"), capsys)
    assert code == 0
    ddp, one, start = _weights(out), _weights(single), _weights(setup / "student")
    assert _max_diff(ddp, start) > 1e-3
    assert _max_diff(ddp, one) < 1e-5


def test_kill_and_resume(setup, tmp_path, capsys, one_thread):
    """A run (a subprocess) killed with SIGKILL after a checkpoint, a half-written newer
    checkpoint left behind, resumes and ends with the parameters of an uninterrupted run."""
    # 24 samples in batches of 3, 2 per step: 4 steps an epoch, a checkpoint every 3 steps
    options = ("--max-steps", "60", "--batch-size", "3", "--grad-accum", "2", "--lr", "1e-2",
               "--save-steps", "3", "--logging-steps", "3", "--seed", "7")
    reference = tmp_path / "reference"
    code, _, _ = _run(_args(setup, reference, *options), capsys)
    assert code == 0

    out = tmp_path / "out"
    command = [sys.executable, "-m", "topkd.cli", *_args(setup, out, *options)]
    log = tmp_path / "killed.log"
    with open(log, "w") as stderr:
        run = subprocess.Popen(command, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=stderr)
        try:
            deadline = time.monotonic() + 180
            # wait for a checkpoint in the second epoch (step 6: 2 steps into it)
            while (last_checkpoint(str(out)) is None or
                   int(last_checkpoint(str(out)).rsplit("-", 1)[1]) < 6):
                assert run.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint within 180 s"
                time.sleep(0.01)
            os.kill(run.pid, signal.SIGKILL)
        finally:
            run.kill()
            run.wait(timeout=60)
    assert run.returncode == -signal.SIGKILL
    assert not (out / "model.safetensors").exists()  # it did not get to the end
    killed_at = int(last_checkpoint(str(out)).rsplit("-", 1)[1])
    assert 6 <= killed_at < 60
    # a checkpoint the kill interrupted while it was being written: no trainer_state.json
    partial = out / f"checkpoint-{killed_at + 3}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(out / f"checkpoint-{killed_at}", partial)
    os.remove(partial / "trainer_state.json")

    # a rerun without --resume, or with other settings, is refused
    code, _, err = _run(_args(setup, out, *options), capsys)
    assert code == 1 and "pass --resume" in err
    code, _, err = _run(_args(setup, out, *options, "--resume", "--lr", "2e-2"), capsys)
    assert code == 1 and "lr: 0.01 -> 0.02" in err

    code, stdout, err = _run(_args(setup, out, *options, "--resume"), capsys)
    assert code == 0
    assert f"resuming from {out / f'checkpoint-{killed_at}'}" in err
    assert f"removing the incomplete {partial}" in err
    assert "trained 60 steps" in stdout and "resumed from" in stdout
    assert _max_diff(_weights(out), _weights(reference)) <= 1e-6
    assert _logged_kd(out) == _logged_kd(reference)


def test_bad_arguments(setup, tmp_path, capsys):
    def error(argv):
        with pytest.raises(SystemExit) as raised:
            main(argv)
        assert raised.value.code == 2
        return capsys.readouterr().err

    assert "one of --teacher (online) and --store (offline) is required" in error(
        _args(setup, tmp_path / "o", teacher=False))
    assert "--beta: only with --divergence jsd" in error(
        _args(setup, tmp_path / "o", "--beta", "0.3"))
    assert "--beta must be in [0.0, 1.0]" in error(
        _args(setup, tmp_path / "o", "--divergence", "jsd", "--beta", "2"))
    assert "--top-p: needs --k" in error(_args(setup, tmp_path / "o", "--top-p", "0.9"))
    assert "--epochs: give --max-steps or --epochs" in error(
        _args(setup, tmp_path / "o", "--max-steps", "3", "--epochs", "1"))
    assert "--eval-steps: needs --eval-data" in error(
        _args(setup, tmp_path / "o", "--eval-steps", "3"))
    assert "both 0: nothing to train" in error(_args(setup, tmp_path / "o", "--kd-weight", "0"))
    assert "is not a directory" in error(
        ["distill", "--teacher", str(tmp_path / "none"), "--student", str(setup / "student"),
         "--data", str(setup / "train.jsonl"), "--out", str(tmp_path / "o")])
    bad = tmp_path / "train.csv"
    bad.write_text("a\n")
    assert "unknown format" in error(
        ["distill", "--teacher", str(setup / "teacher"), "--student", str(setup / "student"),
         "--data", str(bad), "--out", str(tmp_path / "o")])
    assert "required: --data, --out" in error(["distill", "--student", "x"])

    # a teacher with another tokenizer is refused before training
    other = tmp_path / "other"
    _model(3).save_pretrained(other)
    tokenizer = _tokenizer()
    tokenizer.add_tokens(["extra"])
    tokenizer.save_pretrained(other)
    code = main(["distill", "--teacher", str(other), "--student", str(setup / "student"),
                 "--data", str(setup / "train.jsonl"), "--out", str(tmp_path / "o"),
                 "--no-progress"])
    assert code == 1
    assert "is not the teacher's tokenizer" in capsys.readouterr().err


# -- what a new user hit ---------------------------------------------------------------------


def _spy_loads(monkeypatch):
    """The model directories ``from_pretrained`` loads from here on."""
    from transformers import AutoModelForCausalLM

    loaded = []
    original = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, path, *args, **kwargs):
        loaded.append(os.path.basename(os.fspath(path)))
        return original(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    return loaded


def test_options_are_checked_before_the_models_load(setup, tmp_path, capsys, monkeypatch):
    loaded = _spy_loads(monkeypatch)
    out = tmp_path / "out"
    code, _, err = _run(_args(setup, out, "--k", "5000"), capsys)
    assert code == 1 and "k=5000 is larger than the vocabulary (62 tokens)" in err, err
    assert loaded == [] and not out.exists()


def test_a_failed_run_leaves_nothing_that_binds(setup, tmp_path, capsys):
    """A run that fails before its first checkpoint (here: a teacher whose hidden states turn
    NaN, stopped at step 1 with the row named) leaves --out free: a plain rerun with other
    settings runs."""
    from transformers import AutoModelForCausalLM

    broken = tmp_path / "nan-teacher"
    shutil.copytree(setup / "teacher", broken)
    model = AutoModelForCausalLM.from_pretrained(broken)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(broken)
    out = tmp_path / "out"
    code, _, err = _run(_args(setup, out, "--max-steps", "2", "--batch-size", "2",
                              teacher=False) + ["--teacher", str(broken)], capsys)
    assert code == 1
    assert "step 1, batch row 0" in err and "the teacher gave NaN or infinite values" in err
    assert (out / SETTINGS_FILE).exists() and last_checkpoint(str(out)) is None
    code, stdout, err = _run(_args(setup, out, "--max-steps", "2", "--batch-size", "2",
                                   "--k", "8"), capsys)
    assert code == 0, err
    assert "trained 2 steps" in stdout


def test_a_store_of_another_teacher_is_refused(setup, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(3, 6)))
    store = tmp_path / "store"
    build_store(setup / "teacher", data, store, k=8, progress=False)
    other = tmp_path / "other-teacher"
    shutil.copytree(setup / "teacher", other)
    _model(9, scale=6.0).save_pretrained(other)  # the same tokenizer, other weights
    base = ["distill", "--store", str(store), "--student", str(setup / "student"), "--data",
            str(data), "--max-steps", "1", "--batch-size", "2", "--no-progress"]
    code, _, err = _run(base + ["--teacher", str(other), "--out", str(tmp_path / "o1")],
                        capsys)
    assert code == 1 and "was built by another teacher than" in err and "other-teacher" in err
    code, _, err = _run(base + ["--teacher", str(setup / "teacher"), "--out",
                                str(tmp_path / "o2")], capsys)
    assert code == 0, err


def test_a_near_miss_flag_names_the_right_one(setup, tmp_path):
    command = [sys.executable, "-m", "topkd.cli",
               *_args(setup, tmp_path / "o", "--steps", "3")]
    result = subprocess.run(command, capture_output=True, text=True, env=_env(), cwd=ROOT,
                            timeout=120)
    assert result.returncode == 2
    assert "unrecognized arguments: --steps 3 (--steps: did you mean --max-steps?)" in \
        result.stderr, result.stderr
    assert "usage: topkd distill" in result.stderr  # the command's own usage


_HalfTVD = helpers.half_tvd_class("half_tvd_cli")


def test_impl_and_a_registered_divergence_reach_the_loss(setup, tmp_path, capsys, monkeypatch,
                                                          one_thread):
    import topkd.hf.trainer as trainer_module

    topkd.divergences.register(_HalfTVD.name, _HalfTVD)
    seen = helpers.record_options(monkeypatch, trainer_module)
    out = tmp_path / "out"
    code, _, err = _run(_args(setup, out, "--max-steps", "1", "--k", "8", "--impl", "eager",
                              "--divergence", _HalfTVD.name), capsys)
    assert code == 0, err
    assert seen and {(o.impl, o.divergence, o.k) for o in seen} == {("eager", _HalfTVD(), 8)}
    settings = json.loads((out / SETTINGS_FILE).read_text())
    assert (settings["impl"], settings["divergence"]) == ("eager", _HalfTVD.name)
    with pytest.raises(SystemExit):
        main(_args(setup, tmp_path / "bad", "--impl", "triton"))
    assert "invalid choice: 'triton'" in capsys.readouterr().err


def test_padding_free_trains_as_padded_batches(setup, tmp_path, capsys, one_thread):
    """--padding-free packs each micro-batch into one row: the same logged KD at every step
    and the same student as padded batches, online and from a store."""
    store = tmp_path / "store"
    build_store(setup / "teacher", setup / "train.jsonl", store, k=8, logprob_dtype="float32",
                progress=False)
    for source, extra in (("online", ["--k", "8"]), ("offline", ["--store", str(store)])):
        runs = {}
        for name, flag in (("padded", []), ("packed", ["--padding-free"])):
            out = tmp_path / f"{source}-{name}"
            code, stdout, err = _run(_args(setup, out, "--max-steps", "3", "--batch-size", "6",
                                           "--lr", "1e-2", "--logging-steps", "1",
                                           "--ce-weight", "0.5", *extra, *flag,
                                           teacher=source == "online"), capsys)
            assert code == 0, err
            runs[name] = (_logged_kd(out), _weights(out))
        (kd, weights), (kd_packed, weights_packed) = runs["padded"], runs["packed"]
        assert len(kd) == 3 and kd_packed == pytest.approx(kd, rel=1e-5), source
        assert _max_diff(weights_packed, weights) < 1e-5, source
        assert _max_diff(weights, _weights(setup / "student")) > 1e-3


def test_a_sampled_store_distills(setup, tmp_path, capsys):
    """``topkd distill --store`` of a store built with ``--samples``: trains (forward KL), and
    a divergence that samples cannot estimate is refused before any model is loaded."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _texts(4, 6)))
    store = tmp_path / "store"
    build_store(setup / "teacher", data, store, samples=12, progress=False)
    base = ["distill", "--store", str(store), "--student", str(setup / "student"), "--data",
            str(data), "--max-steps", "2", "--batch-size", "2", "--no-progress"]
    code, out, err = _run(base + ["--out", str(tmp_path / "o1")], capsys)
    assert code == 0, err
    code, _, err = _run(base + ["--divergence", "jsd", "--out", str(tmp_path / "o2")], capsys)
    assert code == 1 and "divergence" in err and "sampled" in err
