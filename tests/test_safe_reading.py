"""No code runs from a checkpoint: a marker-writing ``__reduce__`` payload in each pickle of each format,
fed to every reader path, is refused in one line naming the file and the global, and the marker is
never written. Each payload is first shown to work (it writes the marker through an unguarded reader),
so these tests can fail.
"""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_patch.checkpoint_files.allowlist import UnsafePickle, is_allowed
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, write_manifest
from megatron_patch.checkpoint_files.pickles import loads
from megatron_patch.checkpoint_files.safe_torch import (
    SafeFileSystemReader, _AllowListUnpickler, load_refusing, load_torch_file, read_dcp_metadata, safe_dist_load)
from megatron_patch.cli import main
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime.launch import run_local
from tests.training_helpers import launch, launcher_args


class Payload:
    """Pickles as ``posix.system("touch MARKER")``: what a hostile checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "the payload ran"


def _refused(capsys, argv: list[str], what: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "refused" in err and "posix.system" in err and what in err, err
    return err


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("safe")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=1)
    out = {"hf": hf}
    for fmt in ("torch_dist", "legacy"):
        out[fmt] = root / fmt
        assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(out[fmt]), "--tp", "2",
                     "--format", fmt, "--quiet"]) == 0
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _reseal(path: Path) -> Path:
    """An attacker who can change a checkpoint's files can rewrite its manifest too (a digest is no
    signature): the payload must meet the allow-list, not the manifest's digests."""
    for folder in path.parents:
        if (folder / MANIFEST_NAME).exists():
            write_manifest(folder, "attacker", sync=False)
            break
    return path


def _poison_metadata(folder: Path, marker: Path) -> Path:
    path = folder / ".metadata"
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own file: trusted here
    md.planner_data = {"note": Payload(marker)}
    path.write_bytes(pickle.dumps(md))
    return _reseal(path)


def _poison_torch_save(path: Path, marker: Path, keep: bool = True) -> Path:
    obj = torch.load(path, weights_only=False) if keep and path.exists() else {}
    obj = dict(obj, args=Payload(marker))
    torch.save(obj, path)
    return _reseal(path)


def test_the_payload_runs_through_plain_pickle(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_allow_list_admits_checkpoint_records_only():
    for module, name in (("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict"),
                         ("torch", "bfloat16"), ("__builtin__", "set"), ("argparse", "Namespace"),
                         ("torch.distributed.checkpoint.metadata", "Metadata"), ("numpy.dtypes", "UInt32DType")):
        assert is_allowed(module, name), (module, name)
    for module, name in (("posix", "system"), ("os", "system"), ("builtins", "eval"), ("__builtin__", "exec"),
                         ("subprocess", "Popen"), ("torch", "load"), ("numpy", "load"), ("builtins", "getattr"),
                         ("torch.distributed.checkpoint.metadata", "os"), ("numpy.dtypes", "__import__")):
        assert not is_allowed(module, name), (module, name)


def test_torch_free_reader_refuses_instead_of_recording(marker):
    with pytest.raises(UnsafePickle, match=r"^f\.pt: refused: its pickle names posix\.system"):
        loads(pickle.dumps({"a": Payload(marker)}, protocol=2), where="f.pt")


def _weights(folder: Path) -> Path:
    return next(p.parent for p in folder.rglob(".metadata"))


def test_dcp_metadata_reader_refuses(checkpoints, tmp_path, marker):
    folder = _weights(_copy(checkpoints["torch_dist"], tmp_path / "ckpt"))
    path = _poison_metadata(folder, marker)
    with pytest.raises(UnsafePickle, match="posix.system"):
        read_dcp_metadata(path)
    with pytest.raises(UnsafePickle, match="posix.system"):
        SafeFileSystemReader(folder)


def test_clean_metadata_reads_as_torch_does(checkpoints):
    path = _weights(checkpoints["torch_dist"]) / ".metadata"
    ours = read_dcp_metadata(path)
    with open(path, "rb") as f:
        theirs = pickle.load(f)
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_byte_entries_in_distcp_files_are_read_through_the_allow_list(tmp_path, marker):
    """torch's default planner loads a byte entry with torch.load(weights_only=False)."""
    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0), "evil": Payload(marker), "good": "hello"}, checkpoint_id=str(folder), no_dist=True)
    got = {}

    class Capture(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            got[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    state = {"w": torch.zeros(4), "good": ""}
    dcp.load(state, storage_reader=SafeFileSystemReader(folder), planner=Capture(), no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0)) and got == {"good": "hello"}
    with pytest.raises(UnsafePickle, match=r"\(evil\): refused: its pickle names posix\.system"):
        load_refusing({"evil": None}, SafeFileSystemReader(folder))
    # What torch alone does with it: the payload runs (the marker is removed for the fixture's check).
    dcp.load({"evil": None}, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    assert marker.exists()
    marker.unlink()


def test_torch_save_files_are_read_through_the_allow_list(tmp_path, marker):
    path = tmp_path / "rank_00000.pt"
    torch.save({"random": (3, tuple(range(5)), None), "torch": torch.get_rng_state()}, path)
    assert torch.equal(load_torch_file(path)["torch"], torch.get_rng_state())
    _poison_torch_save(path, marker)
    with pytest.raises(UnsafePickle, match=rf"^{path}: refused: its pickle names posix\.system"):
        load_torch_file(path)


@pytest.mark.parametrize("where", [".metadata", "common.pt"])
def test_mcore2hf_and_inspect_refuse_a_poisoned_torch_dist(checkpoints, tmp_path, capsys, marker, where):
    folder = _copy(checkpoints["torch_dist"], tmp_path / "ckpt")
    weights = next(p.parent for p in folder.rglob(".metadata"))
    poisoned = _poison_metadata(weights, marker) if where == ".metadata" else \
        _poison_torch_save(weights / "common.pt", marker)
    _refused(capsys, ["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(tmp_path / "hf")],
             str(poisoned))
    assert not (tmp_path / "hf").exists()
    _refused(capsys, ["inspect", str(folder)], str(poisoned))


def test_mcore2hf_refuses_a_poisoned_legacy_rank_file(checkpoints, tmp_path, capsys, marker):
    folder = _copy(checkpoints["legacy"], tmp_path / "ckpt")
    poisoned = _poison_torch_save(next(folder.rglob("model_optim_rng.pt")), marker)
    _refused(capsys, ["convert", "mcore2hf", "--load-dir", str(folder), "--save-dir", str(tmp_path / "hf")],
             str(poisoned))


def test_align_refuses_a_poisoned_checkpoint(checkpoints, tmp_path, capsys, marker):
    folder = _copy(checkpoints["torch_dist"], tmp_path / "ckpt")
    poisoned = _poison_metadata(next(p.parent for p in folder.rglob(".metadata")), marker)
    _refused(capsys, ["align", "--hf-dir", str(checkpoints["hf"]), "--mcore-dir", str(folder),
                      "--report-dir", str(tmp_path / "report")], str(poisoned))


def _load_one_tensor(folder: str, key: str) -> torch.Tensor:
    """In a process of its own (megatron's load needs a process group): ``key`` through safe_dist_load."""
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_patch.runtime.distributed import init_process_group

    init_process_group()
    want = read_dcp_metadata(Path(folder) / ".metadata").state_dict_metadata[key]
    target = torch.empty(tuple(want.size), dtype=want.properties.dtype)
    return safe_dist_load({"w": ShardedTensor.from_rank_offsets(key, target)}, folder)["w"]


@pytest.mark.slow
def test_safe_dist_load_reads_a_checkpoint_without_common_pt(checkpoints, tmp_path):
    """Other tools (Megatron-Bridge) write no common.pt: the common state is then empty, not an error."""
    weights = _weights(_copy(checkpoints["torch_dist"], tmp_path / "ckpt"))
    (weights / "common.pt").unlink()
    key = "embedding.word_embeddings.weight"
    [got] = run_local(_load_one_tensor, 1, str(weights), key)
    reference = torch.empty_like(got)
    dcp.load({key: reference}, storage_reader=dcp.FileSystemReader(str(weights)), no_dist=True)
    assert torch.equal(got, reference)


@pytest.mark.slow
def test_training_refuses_poisoned_pretrained_weights_and_resume_state(checkpoints, corpus, tmp_path, marker):
    """PRETRAIN_CHECKPOINT_PATH with a poisoned .metadata, and a resume whose RNG file is poisoned: each
    stops before training in one line naming the file, exit 2."""
    folder = _copy(checkpoints["torch_dist"], tmp_path / "ckpt")
    poisoned = _poison_metadata(next(p.parent for p in folder.rglob(".metadata")), marker)
    args = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(tmp_path / "out1"),
                         MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(folder), TRAIN_TOKENS_OR_ITERS=str(2 * 8 * 64),
                         WARMUP_TOKENS_OR_ITERS=str(8 * 64))
    proc = launch(args)
    assert proc.returncode == 2 and f"{poisoned}: refused" in proc.stderr, proc.stderr[-2000:]

    out = tmp_path / "out2"
    args = launcher_args("llama3_1", DATASET_PATH=corpus["prefix"], OUTPUT_BASEPATH=str(out), SAVE_INTERVAL="2",
                         TRAIN_TOKENS_OR_ITERS=str(4 * 8 * 64), WARMUP_TOKENS_OR_ITERS=str(8 * 64))
    first = launch(args, {"MP_EXIT_INTERVAL": "2"})
    assert first.returncode == 0, first.stderr[-2000:]
    rng = next((out / "checkpoint").rglob("rank_00000.pt"))
    _poison_torch_save(rng, marker)
    second = launch(args)
    assert second.returncode == 2 and f"{rng}: refused" in second.stderr, second.stderr[-2000:]


def _enum_by_name_pickle(module: str, cls: str, name: str) -> bytes:
    """A protocol-2 pickle of ``getattr(module.cls, name)``, as some Python 3.11 releases (3.11.2) write an enum member."""
    return (b"\x80\x02c__builtin__\ngetattr\n" + f"c{module}\n{cls}\n".encode() + pickle.dumps(name, protocol=2)[2:-1]
            + b"\x86R.")


def test_a_path_pickled_by_python_3_13_is_read_under_any_python():
    """Python 3.13 moved pathlib's classes into pathlib._local, so megatron-core's files written there name
    pathlib._local.PosixPath: both readers take it as pathlib.PosixPath, on every Python; the module's other
    names stay refused."""
    import pathlib

    data = pickle.dumps(pathlib.PurePosixPath("/ckpt/iter_0000001"), protocol=2)
    data = data.replace(b"cpathlib\nPurePosixPath\n", b"cpathlib._local\nPurePosixPath\n")
    assert b"cpathlib._local\nPurePosixPath\n" in data
    got = _AllowListUnpickler(data, "m").load()
    assert type(got) is pathlib.PurePosixPath and str(got) == "/ckpt/iter_0000001"
    assert loads(data, where="m") is not None
    bad = data.replace(b"cpathlib._local\nPurePosixPath\n", b"cpathlib._local\n_abc\n")
    for read in (lambda d: _AllowListUnpickler(d, "m").load(), lambda d: loads(d, where="m")):
        with pytest.raises(UnsafePickle, match="pathlib._local._abc"):
            read(bad)


def test_an_enum_member_pickled_by_name_is_read_and_no_other_getattr():
    """Some Python 3.11 releases (3.11.2; not 3.11.7) pickle enum members as getattr(EnumClass, "NAME"): torch's and megatron-core's
    files written there name builtins.getattr. The reader that builds objects takes exactly that use and refuses
    a getattr on an allowed class that is not an enum, or a name that is not a member; the inert reader gives records."""
    from megatron.core.enums import ModelType

    member = _enum_by_name_pickle("megatron.core.enums", "ModelType", "encoder_or_decoder")
    assert _AllowListUnpickler(member, "m").load() is ModelType.encoder_or_decoder
    inert = loads(member, where="m")
    assert inert.qualname == "megatron.core.enums.ModelType" and inert.state == {"_name_": "encoder_or_decoder"}
    for module, cls, name in [("argparse", "Namespace", "__init__"), ("megatron.core.enums", "ModelType", "mro"),
                              ("megatron.core.enums", "ModelType", "__class__")]:
        bad = _enum_by_name_pickle(module, cls, name)
        with pytest.raises(UnsafePickle, match="getattr"):
            _AllowListUnpickler(bad, "m").load()
        # the inert reader cannot tell an enum's record from another class's: it gives an inert record, never
        # the attribute (nothing it returns can be called)
        got = loads(bad, where="m")
        assert type(got).__mro__[1].__name__ == "Record" and got.state == {"_name_": name} and not callable(got)
    with pytest.raises(UnsafePickle, match="getattr"):
        loads(_enum_by_name_pickle("megatron.core.enums", "ModelType", "not a name"), where="m")


def test_a_stored_tensor_whose_view_leaves_its_storage_is_refused_in_one_line(tmp_path):
    """A legacy rank file's tensor whose stride reaches past its storage (a sound archive, CRCs and all): torch's
    as_strided failed inside mcore2hf ("setStorage ... out of bounds"), an internal error. It is refused as
    torch_dist's chunks are (checkpoint_files.pickles.lies_outside_its_storage)."""
    import dataclasses

    import torch

    from megatron_patch.checkpoint_files.pickles import TensorRef
    from megatron_patch.checkpoint_files.torch_files import LazyTorchFile
    from megatron_patch.errors import UserError

    torch.save({"norm": torch.ones(250, 256)}, tmp_path / "model_optim_rng.pt")
    lazy = LazyTorchFile(tmp_path / "model_optim_rng.pt")
    ref = lazy.obj["norm"]
    assert isinstance(ref, TensorRef) and torch.equal(lazy.load(ref), torch.ones(250, 256))
    for bad in (dataclasses.replace(ref, stride=(60000, 1)), dataclasses.replace(ref, offset=-1),
                dataclasses.replace(ref, stride=(256, -1)), dataclasses.replace(ref, offset=64000)):
        with pytest.raises(UserError, match="lies outside its storage: the file is damaged"):
            lazy.load(bad)


def test_a_rank_file_holding_one_tensor_under_both_specs_names_is_refused(tmp_path):
    """The local spec's input_layernorm.weight and TE's linear_qkv.layer_norm_weight are one tensor: a rank file
    holding both (7s in one, 1s in the other) was exported with whichever came last, silently."""
    import torch

    from megatron_patch.checkpoint.legacy import open_rank_file
    from megatron_patch.errors import UserError

    path = tmp_path / "model_optim_rng.pt"
    qkv = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.ones(9, 3)}
    torch.save({"model": {**qkv, "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": torch.ones(3),
                          "decoder.layers.0.input_layernorm.weight": torch.full((3,), 7.0)}}, path)
    with pytest.raises(UserError, match="both the model's decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"):
        open_rank_file(path)
    torch.save({"model": {**qkv, "decoder.layers.0.input_layernorm.weight": torch.full((3,), 7.0)}}, path)
    _, refs = open_rank_file(path)  # the local spec's name alone: read as TE's
    assert sorted(refs) == ["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                            "decoder.layers.0.self_attention.linear_qkv.weight"]
