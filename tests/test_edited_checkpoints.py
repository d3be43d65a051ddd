"""A checkpoint changed on purpose after it was written (checkpoint surgery, a debugging session) no longer matches
its manifest. Every reader refuses it in one line that names the switch reading it as it is: --no-verify for
`mpatch convert mcore2hf` and `mpatch align`, MP_NO_VERIFY=true for a launch (PRETRAIN_CHECKPOINT_PATH and
the run's own checkpoints)."""

from __future__ import annotations

import json
import shutil

import pytest

from megatron_patch.checkpoint.sidecar import SIDECAR_NAME
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME
from megatron_patch.cli import main
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("edited")
    hf = make_tiny_hf_checkpoint("llama3_1", root / "hf", seed=6)
    mcore = root / "mcore"
    assert main(["convert", "hf2mcore", "--hf-dir", str(hf), "--save-dir", str(mcore), "--quiet"]) == 0
    return {"hf": hf, "mcore": mcore}


def edited_copy(mcore, out):
    """``mcore`` with a note added to its sidecar by hand: the same model, but no longer what its manifest lists."""
    shutil.copytree(mcore, out)
    sidecar = json.loads((out / SIDECAR_NAME).read_text())
    sidecar["notes"].append("reviewed by hand")
    (out / SIDECAR_NAME).write_text(json.dumps(sidecar))
    return out


def _refused_naming(capsys, argv, switch) -> None:
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if " error: " in line]  # transformers' bars aside
    assert len(errors) == 1 and "after it was written" in errors[0], errors
    assert f"if it was changed on purpose, {switch} reads it as it is" in errors[0], errors


def test_mcore2hf_of_an_edited_checkpoint_names_no_verify(converted, tmp_path, capsys):
    edited = edited_copy(converted["mcore"], tmp_path / "edited")
    argv = ["convert", "mcore2hf", "--load-dir", str(edited), "--save-dir", str(tmp_path / "back"), "--quiet"]
    _refused_naming(capsys, argv, "--no-verify")
    assert main(argv + ["--no-verify"]) == 0


@pytest.mark.parametrize("damage", ["{not json", '{"files": {"/etc/passwd": {}}, "manifest_version": 1, '
                                                 '"digest": "xxh3_128"}'], ids=["not JSON", "a malformed entry"])
def test_mcore2hf_of_a_checkpoint_whose_manifest_is_damaged_names_no_verify(converted, tmp_path, capsys, damage):
    """A damaged manifest said 'fix or re-download it' without the switch that reads the checkpoint as it is."""
    damaged = tmp_path / "damaged"
    shutil.copytree(converted["mcore"], damaged)
    (damaged / MANIFEST_NAME).write_text(damage)
    argv = ["convert", "mcore2hf", "--load-dir", str(damaged), "--save-dir", str(tmp_path / "back"), "--quiet"]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if " error: " in line]
    assert len(errors) == 1 and "the output's manifest is damaged" in errors[0], errors
    assert "if it was changed on purpose, --no-verify reads it as it is" in errors[0], errors
    assert main(argv + ["--no-verify"]) == 0


@pytest.mark.slow
def test_align_of_an_edited_checkpoint_takes_no_verify(converted, tmp_path, capsys):
    edited = edited_copy(converted["mcore"], tmp_path / "edited")
    argv = ["align", "--hf-dir", str(converted["hf"]), "--mcore-dir", str(edited), "--dtype", "fp32", "--seq-len", "16",
            "--batch", "1", "--quiet"]
    _refused_naming(capsys, argv, "--no-verify")
    assert main(argv + ["--no-verify"]) == 0, capsys.readouterr().err


def _load_starting_weights_worker(args: list[str], env: dict) -> None:
    from megatron_patch.models.blocks.builder import build_model_chunks
    from megatron_patch.runtime import init_model_parallel
    from megatron_patch.training.checkpointing import load_starting_weights
    from megatron_patch.training.validation import resolve

    cfg = resolve("llama3_1", args, env=env, check_paths=False)
    init_model_parallel(cfg.layout)
    chunks = build_model_chunks(cfg.arch, cfg.layout, cfg.precision.dtype)
    load_starting_weights(cfg, chunks, cfg.pretrain_checkpoint)


def test_a_launch_from_an_edited_checkpoint_takes_mp_no_verify(converted, tmp_path):
    from megatron_patch.errors import UserError
    from megatron_patch.runtime.launch import run_local
    from megatron_patch.training.launcher_options import OPTION
    from tests.training_helpers import launcher_args

    assert "MP_NO_VERIFY" in OPTION
    edited = edited_copy(converted["mcore"], tmp_path / "edited")
    args = launcher_args(MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(edited), OUTPUT_BASEPATH=str(tmp_path / "out"))
    with pytest.raises(UserError) as err:
        run_local(_load_starting_weights_worker, 1, args, {})
    assert "after it was written" in str(err.value)
    assert "if it was changed on purpose, MP_NO_VERIFY=true reads it as it is" in str(err.value)
    run_local(_load_starting_weights_worker, 1, args, {"MP_NO_VERIFY": "true"})


# --- a forged .metadata (no manifest: another tool's checkpoint) ----------------------------------------------

_LN = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
_FINAL = "decoder.final_layernorm.weight"


def _forge(md, case: str) -> None:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    sd, st = md.state_dict_metadata, md.storage_data
    if case == "overlap":  # a second chunk of layer 0's norm whose storage entry is layer 3's record (the audit's D1)
        sd[_LN].chunks = list(sd[_LN].chunks) + [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 64]))]
        layer3 = next(k for k in st if k.fqn == _LN and list(k.offset) == [3, 0])
        st[MetadataIndex(fqn=_LN, offset=torch.Size([0, 0]), index=1)] = st[layer3]
    elif case == "alias":  # the final norm's entry points at a [1, 64] record
        source = next(k for k in st if k.fqn == _LN)
        for k in [k for k in st if k.fqn == _FINAL]:
            st[k] = st[source]
    elif case == "missing":  # the final norm is not in the checkpoint at all
        del sd[_FINAL]
        for k in [k for k in st if k.fqn == _FINAL]:
            del st[k]
    elif case == "dtype":  # declared float16, stored float32
        sd[_FINAL].properties.dtype = torch.float16


_FORGED = {"overlap": "share bytes of", "alias": "share bytes of",
           "missing": f"has no tensor '{_FINAL}': it was not written for this model",
           "dtype": f"chunk of {_FINAL} at [0] holds a float32 tensor of shape [64] where .metadata says float16"}


def forged_copy(mcore, out, case: str):
    """``mcore`` as another tool's checkpoint (no manifest) whose ``.metadata`` was edited as a forger would."""
    import pickle

    shutil.copytree(mcore, out)
    (out / MANIFEST_NAME).unlink()
    path = out / "release" / ".metadata"
    md = pickle.loads(path.read_bytes())
    _forge(md, case)
    path.write_bytes(pickle.dumps(md))
    return out


@pytest.mark.parametrize("case", sorted(_FORGED))
def test_a_launch_from_a_forged_metadata_is_refused_in_one_line(converted, tmp_path, case):
    """PRETRAIN_CHECKPOINT_PATH (the load a launch and resume share, safe_dist_load): the overlap and the dtype
    edit were loaded and trained on silently; the alias and the missing tensor stopped as torch's
    CheckpointException, an 'internal error'."""
    from megatron_patch.errors import UserError
    from megatron_patch.runtime.launch import run_local
    from tests.training_helpers import launcher_args

    forged = forged_copy(converted["mcore"], tmp_path / "forged", case)
    args = launcher_args(MODEL_SIZE="auto", PRETRAIN_CHECKPOINT_PATH=str(forged), OUTPUT_BASEPATH=str(tmp_path / "out"))
    with pytest.raises(UserError) as err:
        run_local(_load_starting_weights_worker, 1, args, {})
    assert _FORGED[case] in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("case", sorted(_FORGED))
def test_align_of_a_forged_metadata_is_refused_in_one_line(converted, tmp_path, capsys, case):
    """align --mcore-dir loads in worker ranks: a refusal there is exit 2 and one line, not exit 3 with torch's
    traceback (alias, missing), nor a 'NOT aligned' report from wrong weights (overlap, exit 1)."""
    forged = forged_copy(converted["mcore"], tmp_path / "forged", case)
    argv = ["align", "--hf-dir", str(converted["hf"]), "--mcore-dir", str(forged), "--dtype", "fp32", "--seq-len", "16",
            "--batch", "1", "--quiet"]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if " error: " in line]
    assert len(errors) == 1 and _FORGED[case] in errors[0], errors
