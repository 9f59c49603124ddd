"""GGUF files as models: the header read in pure Python, refusals before anything starts, conversion once into the
model cache (whole or not at all), a cache another user could change or replace refused (by the run as it starts and
by each actor as it loads the model), and a run trained from one."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_files import SMOLLM2, TinyGGUF, write_gguf
from tmpfs import FILLER, fill, tmpfs

from actors.models.facts import ModelFacts, TinyModelSpec
from actors.models.gguf import convert as gguf_model
from actors.models.gguf.header import GGML_TYPES, ArrayOf, read_header
from actors.models.source import CACHE_ENV, MARKER, ModelSource, ModelSourceError, check_before_loading
from mesh.run import dry_run
from mesh.topology.schema import TopologyError, load_topology

ROOT = Path(__file__).resolve().parents[1]
MATH = ROOT / "topologies" / "math_small.yaml"
SHORT = ["loop.steps=2", "loop.prompts_per_step=2", "loop.group_size=2", "actors.generator.max_new_tokens=4"]
SHORT += ["loop.warm_start.steps=1", "loop.evaluation.every=0", "checkpointing.every=1"]


def as_model(path: Path | str) -> list[str]:
    return ["model.init=null", f"model.path={path}"]


def refused(overrides: list[str]) -> str:
    """The one-paragraph message checking math_small.yaml with ``overrides`` refuses it with."""
    with pytest.raises(TopologyError) as info:
        load_topology(MATH, overrides)
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def mesh_run(args: list[str], cache: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), CACHE_ENV: str(cache)}
    command = [sys.executable, "-m", "mesh.run", str(MATH), "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny(tmp_path) -> Path:
    return TinyGGUF().write(tmp_path / "tiny.gguf")


# ----------------------------------------------------------------------------- the header


def test_the_ggml_type_table_is_the_gguf_packages_and_says_which_types_dequantize():
    assert {key: (kind.name, kind.block_size, kind.type_size) for key, kind in GGML_TYPES.items()} == {
        int(kind): (kind.name, *sizes) for kind, sizes in gguf.GGML_QUANT_SIZES.items()
    }
    for key, kind in GGML_TYPES.items():
        block = np.zeros(kind.type_size, dtype=np.uint8)
        try:
            gguf.dequantize(block, gguf.GGMLQuantizationType(key))
            dequantized = True
        except NotImplementedError:
            dequantized = False
        assert kind.dequantized == dequantized, kind.name


def test_the_header_is_read_as_the_gguf_package_reads_it(tmp_path):
    values = {"u8": 7, "i8": -7, "u16": 700, "i16": -700, "u32": 70000, "i32": -70000, "f32": 0.5, "bool": True}
    values |= {"str": "päth", "u64": 2**40, "i64": -(2**40), "f64": 0.25}
    kinds = [gguf.GGUFValueType[name] for name in ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32")]
    kinds += [gguf.GGUFValueType[name] for name in ("FLOAT32", "BOOL", "STRING", "UINT64", "INT64", "FLOAT64")]
    metadata = {f"t.{key}": (value, kind) for (key, value), kind in zip(values.items(), kinds, strict=True)}
    metadata["t.nested"] = ([[1, 2], [3], ["a", "b"]], gguf.GGUFValueType.ARRAY)
    metadata["t.long"] = ([f"token{i}" for i in range(1000)], gguf.GGUFValueType.ARRAY)
    metadata["t.long_nested"] = ([[i, i] for i in range(100)], gguf.GGUFValueType.ARRAY)
    q8 = gguf.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0)
    write_gguf(tmp_path / "all.gguf", "llama", {"a": np.ones((3, 5), np.float32), "b": q8}, metadata)

    header, theirs = read_header(tmp_path / "all.gguf"), gguf.GGUFReader(tmp_path / "all.gguf")
    for key in values:
        assert header.metadata[f"t.{key}"] == pytest.approx(theirs.fields[f"t.{key}"].contents()), key
    assert header.metadata["t.nested"] == ((1, 2), (3,), ("a", "b"))
    assert header.metadata["t.long"] == ArrayOf(gguf.GGUFValueType.STRING, 1000)
    assert header.metadata["t.long_nested"] == ArrayOf(gguf.GGUFValueType.ARRAY, 100)
    assert [(t.name, t.shape, t.ggml_type, t.nbytes) for t in header.tensors] == [
        (t.name, tuple(reversed(t.shape.tolist())), int(t.tensor_type), t.n_bytes) for t in theirs.tensors
    ]


# ----------------------------------------------------------------------------- conversion


@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_a_tiny_gguf_converts_into_the_directory_its_header_describes(tmp_path, cache, arch, tied):
    spec = TinyModelSpec(arch=arch, layers=3, heads=4, kv_heads=1, tokenizer="bpe")  # heads of 16
    path = TinyGGUF(spec, tied).write(tmp_path / f"{arch}.gguf")
    source = ModelSource.of(str(path), "model.path")
    assert source.converted() is None
    directory = source.directory()
    assert directory == source.cache_entry and directory.parent == cache
    assert source.facts() == ModelFacts.of_directory(directory) == ModelFacts.of_spec(spec, None)
    assert json.loads((directory / MARKER).read_text())["checksum"] == source.checksum
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in directory.iterdir()
    }
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())
    assert list(cache.iterdir()) == [directory]  # nothing else: no temporary directory left


def test_a_second_load_uses_the_converted_directory(cache, tiny, monkeypatch):
    calls = []
    convert = gguf_model.dequantized
    monkeypatch.setattr(gguf_model, "dequantized", lambda *args: calls.append(args) or convert(*args))
    first = ModelSource.of(str(tiny), "model.path").directory()
    written = (first / MARKER).stat().st_mtime_ns
    assert ModelSource.of(str(tiny), "model.path").directory() == first
    assert len(calls) == 1 and (first / MARKER).stat().st_mtime_ns == written


def test_a_process_that_converts_second_keeps_the_first_ones_directory(cache, tiny):
    source = ModelSource.of(str(tiny), "model.path")
    first = source.directory()
    marker = (first / MARKER).read_text()
    assert source._convert() == first  # as a process that started converting before the first finished
    assert (first / MARKER).read_text() == marker and list(cache.iterdir()) == [first]


def test_an_hf_teacher_bound_with_a_gguf_file_converts_it_where_it_loads(tmp_path, cache, tiny):
    from actors.tasks import Problem
    from actors.teachers.bindings import BindingConfig, Student
    from actors.teachers.bindings.hf import HFTeacher

    student = ModelSource.of(str(TinyGGUF().write(tmp_path / "student.gguf", seed=1)), "model.path").directory()
    teacher = HFTeacher(BindingConfig(kind="hf", path=str(tiny)), Student(str(student), max_new_tokens=3, seed=0))
    assert ModelSource.of(str(tiny), "model.path").converted() is not None
    (trace,) = teacher.trace([Problem(prompt="1+2=", answer="3")])
    assert isinstance(trace, str)


def test_a_directory_without_the_marker_is_never_used(cache, tiny):
    source = ModelSource.of(str(tiny), "model.path")
    source.cache_entry.mkdir(parents=True)
    (source.cache_entry / "config.json").write_text("{}")  # as a conversion cut short would leave it
    assert source.converted() is None
    assert source.directory() == source.cache_entry and (source.cache_entry / MARKER).is_file()


def test_a_converted_model_changed_since_its_conversion_is_refused_naming_the_file(cache, tiny, capsys):
    entry = ModelSource.of(str(tiny), "model.path").directory()
    pristine = {path.name: path.read_bytes() for path in entry.iterdir()}
    weights = bytearray(pristine["model.safetensors"])
    weights[-1] ^= 1  # one bit of the last weight
    config = {**json.loads(pristine["config.json"]), "rms_norm_eps": 0.5}

    def same_times(path: Path, data: bytes) -> None:  # its size and times as before: only its ctime tells
        before = path.stat()
        path.write_bytes(data)
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))

    changes = {
        "model.safetensors was changed": lambda: same_times(entry / "model.safetensors", bytes(weights)),
        "config.json was changed": lambda: (entry / "config.json").write_text(json.dumps(config)),
        "tokenizer.json is gone": lambda: (entry / "tokenizer.json").unlink(),
        "modeling_custom.py was added": lambda: (entry / "modeling_custom.py").write_text("import os\n"),
    }
    for change, make in changes.items():
        assert ModelSource.of(str(tiny), "model.path").converted() == entry  # its digests known to this process
        make()
        with pytest.raises(ModelSourceError) as info:
            ModelSource.of(str(tiny), "model.path").directory()  # as the next run asks
        message = str(info.value)
        assert f"; {entry} is no longer what the conversion wrote ({change}" in message, message
        assert message.endswith(f"remove {entry}, and the run converts the file again") and "\n" not in message
        assert dry_run(str(MATH), as_model(tiny), None) == 0  # --dry-run says so, with no traceback
        assert change in capsys.readouterr().out
        (entry / "modeling_custom.py").unlink(missing_ok=True)
        for name, data in pristine.items():
            (entry / name).write_bytes(data)
    shutil.rmtree(entry)
    assert ModelSource.of(str(tiny), "model.path").directory() == entry  # converted again, as the message says


def test_a_model_cache_other_users_can_write_is_refused_naming_it_and_the_fix(cache, tiny):
    source = ModelSource.of(str(tiny), "model.path")
    entry = source.directory()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # as the conversion made it, whatever the umask
    for directory, mode in ((cache, 0o777), (cache, 0o775), (entry, 0o757)):
        directory.chmod(mode)
        with pytest.raises(ModelSourceError) as info:
            ModelSource.of(str(tiny), "model.path").directory()
        message = str(info.value)
        assert f"; {directory} is writable by other users (mode {mode:04o}), so another user" in message, message
        assert f"chmod go-w {directory}), or set MESH_MODEL_CACHE to a directory" in message and "\n" not in message
        directory.chmod(0o700)
    shutil.rmtree(entry)
    cache.chmod(0o1777)  # shared, as /tmp is: refused before anything is converted into it
    with pytest.raises(ModelSourceError, match="writable by other users"):
        source.check_cache()
    assert list(cache.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_model_cache_of_another_user_is_refused(cache, tiny):
    entry = ModelSource.of(str(tiny), "model.path").directory()
    for directory in (cache, entry):
        os.chown(directory, 65534, 65534)
        owned = f"; {directory} is owned by another user \\(uid 65534, mode 0700\\)"
        with pytest.raises(ModelSourceError, match=owned):
            ModelSource.of(str(tiny), "model.path").directory()
        os.chown(directory, 0, 0)


def test_a_file_of_a_converted_model_that_another_user_could_change_is_refused(cache, tiny):
    entry = ModelSource.of(str(tiny), "model.path").directory()
    weights = entry / "model.safetensors"
    weights.chmod(0o646)  # its bytes as the conversion wrote them: only its mode says another user could write it
    for ask in (lambda: ModelSource.of(str(tiny), "model.path").directory(), lambda: check_before_loading(entry)):
        with pytest.raises(ModelSourceError) as info:
            ask()
        message = str(info.value)
        assert f"; {weights} is writable by other users (mode 0646), so another user could change" in message
        assert f"chmod go-w {weights}), or set MESH_MODEL_CACHE" in message and "\n" not in message
    weights.chmod(0o644)
    check_before_loading(entry)
    if os.geteuid() == 0:  # giving it to another user needs root
        os.chown(weights, 65534, 65534)
        with pytest.raises(ModelSourceError, match=f"; {weights} is owned by another user \\(uid 65534, mode 0644\\)"):
            check_before_loading(entry)


def test_a_cache_reached_through_a_directory_others_could_replace_it_in_is_refused(tmp_path, tiny, monkeypatch):
    """A user who can write a directory on the way to the cache could put a cache of theirs in its place; in a
    sticky directory, as /tmp is, only the owner of an entry can, so one of this user's there is safe."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # whatever the umask
    cache = shared / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    source = ModelSource.of(str(tiny), "model.path")
    with pytest.raises(ModelSourceError) as info:
        source.directory()
    message = str(info.value)
    assert f"; on the way to it, {cache} (not made yet) lies in {shared} (owner uid {os.getuid()}, mode 0777)" in (
        message
    )
    assert f"(chmod go-w {shared}), or set MESH_MODEL_CACHE" in message and "\n" not in message
    assert list(shared.iterdir()) == []  # refused before anything is converted
    shared.chmod(0o1777)
    entry = source.directory()
    check_before_loading(entry)
    shared.chmod(0o777)  # after the conversion: the run's check and the actors' refuse it
    for ask in (source.converted, lambda: check_before_loading(entry)):
        with pytest.raises(ModelSourceError, match=f"on the way to it, {cache} \\(owner uid {os.getuid()}\\) lies in"):
            ask()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_cache_reached_through_another_users_directory_or_link_is_refused(tmp_path, tiny, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    cache = shared / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))
    entry = ModelSource.of(str(tiny), "model.path").directory()
    os.chown(shared, 65534, 65534)  # its owner could replace the cache, even with the directory mode 0755
    with pytest.raises(ModelSourceError, match=f"lies in {shared} \\(owner uid 65534, mode 0755\\)"):
        check_before_loading(entry)
    os.chown(shared, 0, 0)
    shared.chmod(0o1777)  # sticky: the cache swapped for another user's link to a copy of it
    cache.rename(tmp_path / "copy")
    cache.symlink_to(tmp_path / "copy")
    os.lchown(cache, 65534, 65534)
    with pytest.raises(ModelSourceError, match=f"on the way to it, {cache} \\(owner uid 65534\\) lies in {shared}"):
        check_before_loading(entry)


def test_symlinks_are_followed_on_the_way_to_the_cache_and_refused_for_an_entry(tmp_path, cache, tiny, monkeypatch):
    entry = ModelSource.of(str(tiny), "model.path").directory()
    shutil.copytree(entry, tmp_path / "copy")  # whole, its marker and its files as the conversion wrote them
    entry.rename(tmp_path / "moved")
    entry.symlink_to(tmp_path / "copy")  # swapped in for the entry
    for ask in (ModelSource.of(str(tiny), "model.path").converted, lambda: check_before_loading(entry)):
        with pytest.raises(ModelSourceError) as info:
            ask()
        message = str(info.value)
        assert f"; {entry} is a symlink (to {tmp_path / 'copy'}), not the directory the conversion wrote" in message
        assert message.endswith(f"remove {entry}, and the run converts the file again")
    entry.unlink()
    (tmp_path / "moved").rename(entry)
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)
    cache.rename(tmp_path / "open" / "cache")
    (tmp_path / "link").symlink_to(tmp_path / "open")  # a link of this user's, in its own directory, to an open one
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "link" / "cache"))
    with pytest.raises(ModelSourceError, match=f"lies in {tmp_path / 'open'} \\(owner uid {os.getuid()}, mode 0777"):
        ModelSource.of(str(tiny), "model.path").converted()


def test_a_directory_in_the_cache_without_its_marker_is_refused_and_one_outside_passes(tmp_path, cache, tiny):
    entry = ModelSource.of(str(tiny), "model.path").directory()
    (entry / MARKER).unlink()  # nothing says what it holds is the model
    with pytest.raises(ModelSourceError, match=f"; {entry} has no whole {MARKER} recording the files"):
        check_before_loading(entry)
    shutil.copytree(entry, tmp_path / "model")
    (tmp_path / "model").chmod(0o777)
    check_before_loading(tmp_path / "model")  # a directory of the user's own, not the cache's: what loads it says


async def test_an_actor_checks_a_converted_model_as_it_starts_a_restarted_one_too(cache, tiny, monkeypatch):
    """The run checks the cache as it starts; a generator started (or restarted, as the fleet replaces a lost one:
    the same actor spawned again) after the cache changed refuses to load it."""
    from local_procs import local_procs

    from actors.basics.compute import Compute
    from actors.generator.actor import Generator
    from actors.generator.config import GeneratorConfig

    entry = ModelSource.of(str(tiny), "model.path").directory()
    monkeypatch.delenv(CACHE_ENV)  # the actor knows the entry by its marker, whatever its environment
    procs = local_procs(1)
    cfg = GeneratorConfig(mesh="g", engine="hf", max_new_tokens=4)
    try:
        await procs.spawn("first", Generator, str(entry), cfg, Compute(1)).start.call_one()
        config = entry / "config.json"
        config.write_text(config.read_text() + " ")  # changed while the run runs
        with pytest.raises(Exception, match="config.json was changed"):
            await procs.spawn("restarted", Generator, str(entry), cfg, Compute(1)).start.call_one()
    finally:
        await procs.stop()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> tuple[ModelSource, Path]:
    """The packaged SmolLM2-135M, converted once for this module's tests."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("smollm2")))
        source = ModelSource.of(SMOLLM2, "model.path")
        return source, source.directory()


def test_the_packaged_smollm2_converts_once_into_the_directory_its_header_describes(smollm2, monkeypatch):
    source, directory = smollm2
    monkeypatch.setenv(CACHE_ENV, str(directory.parent))
    monkeypatch.setattr(gguf_model, "dequantized", None)  # a second conversion would fail
    assert ModelSource.of(SMOLLM2, "model.path").directory() == directory
    facts = source.facts()
    assert facts == ModelFacts.of_directory(directory)
    assert facts.head_size == 64 and facts.tensors["lm_head.weight"] == (49152, 576)  # tied
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["eos_token_id"]) == (30, 3, 2)
    assert (directory / "chat_template.jinja").is_file()


# ----------------------------------------------------------------------------- refusals


def test_files_that_are_not_whole_gguf_models_are_refused_naming_the_key(tmp_path, tiny):
    (tmp_path / "text.gguf").write_text("not a model")
    assert "model.path" in (message := refused(as_model(tmp_path / "text.gguf"))) and "is not a GGUF file" in message
    data = tiny.read_bytes()
    (tmp_path / "head.gguf").write_bytes(data[:1000])
    assert "is cut short: its header ends" in refused(as_model(tmp_path / "head.gguf"))
    (tmp_path / "data.gguf").write_bytes(data[:-100])
    assert "is cut short: tensor output_norm.weight's data runs to byte" in refused(as_model(tmp_path / "data.gguf"))
    assert "is not a regular file or directory" in refused(as_model("/dev/null"))
    assert "names nothing" in refused(as_model(tmp_path / "missing.gguf"))


def test_a_model_this_loader_cannot_dequantize_is_refused(tmp_path):
    write_gguf(tmp_path / "rwkv.gguf", "rwkv6", {"token_embd.weight": np.ones((4, 8), np.float32)})
    message = refused(as_model(tmp_path / "rwkv.gguf"))
    assert "architecture 'rwkv6'" in message and "llama, qwen2, qwen3" in message
    write_gguf(tmp_path / "ints.gguf", "llama", {"token_embd.weight": np.ones((4, 8), np.int32)})
    assert "as I32, which the gguf package cannot dequantize" in refused(as_model(tmp_path / "ints.gguf"))


def test_a_tensor_a_model_has_no_place_for_or_one_it_lacks_is_refused(tmp_path):
    kinds = gguf.GGUFValueType
    metadata = {"llama.block_count": (1, kinds.UINT32), "llama.attention.head_count": (1, kinds.UINT32)}
    metadata["tokenizer.ggml.tokens"] = (["a", "b"], kinds.ARRAY)
    embedding = {"token_embd.weight": np.ones((2, 8), np.float32)}
    write_gguf(tmp_path / "lacks.gguf", "llama", embedding, metadata)
    assert "lacks 10 weight(s) a llama model of 1 layers has" in refused(as_model(tmp_path / "lacks.gguf"))
    write_gguf(tmp_path / "odd.gguf", "llama", embedding | {"blk.0.ssm_a": np.ones(8, np.float32)}, metadata)
    assert "holds tensor blk.0.ssm_a, which a llama model has no place for" in refused(as_model(tmp_path / "odd.gguf"))


def test_a_package_or_gguf_library_that_is_not_installed_is_refused_naming_the_install(tiny, monkeypatch):
    message = refused(as_model("package:no_such_pkg/x.gguf"))
    assert "package no_such_pkg, which is not installed" in message and "pip install no_such_pkg" in message
    monkeypatch.setattr("actors.models.source.find_module", lambda name: name != "gguf")
    assert "pip install -e '.[models]'" in refused(as_model(tiny))


def test_reference_and_teacher_paths_take_gguf_files_and_are_checked_the_same(tmp_path, tiny):
    kl = ["actors.trainer.loss.policy.kl_coef=0.01", "actors.reference.placement=in_trainer"]
    load_topology(MATH, [*as_model(tiny), *kl, f"actors.reference.path={tiny}"])
    (tmp_path / "bad.gguf").write_bytes(b"GGUF")
    assert "actors.reference.path" in refused([*kl, f"actors.reference.path={tmp_path / 'bad.gguf'}"])
    teacher = f"actors.teachers.bindings.big={{kind: hf, path: {tmp_path / 'bad.gguf'}}}"
    assert "hf teacher path" in refused([teacher])


def test_a_cache_that_cannot_be_written_exits_2_before_anything_starts(tmp_path, tiny):
    (tmp_path / "file").write_text("")
    done = mesh_run([*(f"--set={o}" for o in as_model(tiny)), "--run-root", str(tmp_path / "runs")], tmp_path / "file")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "model cache" in done.stderr and "MESH_MODEL_CACHE" in done.stderr and "converting" not in done.stdout
    assert not (tmp_path / "runs").exists()
    with tmpfs(tmp_path / "ro", size="1m", read_only=True) as read_only:
        dry = mesh_run(["--dry-run", *(f"--set={o}" for o in as_model(tiny))], read_only / "models")
        assert dry.returncode == 0 and "cannot run it:" in dry.stdout and "Read-only file system" in dry.stdout


def test_a_disk_that_fills_while_converting_leaves_nothing_a_later_load_uses(tmp_path, tiny, monkeypatch):
    source = ModelSource.of(str(tiny), "model.path")
    with tmpfs(tmp_path / "disk", size="2m") as disk:
        disk.chmod(0o700)  # a tmpfs is mode 1777, a cache that other users could write
        monkeypatch.setenv(CACHE_ENV, str(disk))
        fill(disk, leave=gguf_model.float32_bytes(read_header(tiny)) + 8192)  # room for the weights, not all files
        with pytest.raises(ModelSourceError, match="could not be written .*No space left on device.*MESH_MODEL_CACHE"):
            source.directory()
        assert [p.name for p in disk.iterdir()] == [FILLER] and source.converted() is None
        (disk / FILLER).unlink()
        assert source.directory() == source.cache_entry and source.converted() == source.cache_entry


# ----------------------------------------------------------------------------- a run


def test_a_run_trains_a_gguf_model_converted_once_and_resumes_from_it(tmp_path, tiny):
    cache, runs = tmp_path / "cache", tmp_path / "runs"
    kl = ["actors.trainer.loss.policy.kl_coef=0.01", "actors.reference.placement=in_trainer"]
    sets = [f"--set={o}" for o in [*as_model(tiny), *SHORT, *kl, f"actors.reference.path={tiny}"]]
    dry = mesh_run(["--dry-run", *sets], cache)
    assert dry.returncode == 0 and "tiny.gguf, not converted yet: the run converts it into" in dry.stdout
    assert not cache.exists()

    done = mesh_run([*sets, "--run-root", str(runs)], cache, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("model: converting tiny.gguf into a Hugging Face directory") == 1  # policy and reference
    (entry,) = cache.iterdir()
    (run,) = runs.iterdir()
    assert json.loads((run / "final" / "config.json").read_text())["model_type"] == "llama"

    checkpoint = next((run / "checkpoints").iterdir())
    resumed = mesh_run(["--dry-run", *sets, "--set=loop.steps=3", "--resume", str(checkpoint)], cache)
    assert resumed.returncode == 0 and f"converted in {entry}" in resumed.stdout, resumed.stderr
