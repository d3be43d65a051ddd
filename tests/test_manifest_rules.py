"""An output holds exactly what its manifest lists (issue 34, N7): ``mpatch verify`` names every file the
manifest does not list and every listed file that is a symlink, leads outside the folder or is not a regular
file, and refuses an empty manifest; every reader that checks a manifest (mcore2hf, the loads for training and
align) applies the same rules (``checkpoint_files.manifest.check_coverage``) before it reads a byte."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_patch.cli import main
from megatron_patch.checkpoint_files.manifest import MANIFEST_NAME, IntegrityError, write_manifest
from megatron_patch.convert.checkpoint import hf_to_mcore
from megatron_patch.models.description.tiny import make_tiny_hf_checkpoint
from megatron_patch.runtime.distributed import ParallelLayout
from tests.convert_helpers import leftovers, run_cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    hf = make_tiny_hf_checkpoint("llama3_1", tmp_path_factory.mktemp("hf") / "llama", seed=4)
    out = tmp_path_factory.mktemp("ck") / "ck"
    hf_to_mcore(hf, out, ParallelLayout(), progress=False)
    return out


@pytest.fixture
def work(ckpt, tmp_path) -> Path:
    """A copy of the converted checkpoint to spoil."""
    return Path(shutil.copytree(ckpt, tmp_path / "ck"))


def _one_line(rc: int, err: str, *words: str) -> None:
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, (w, err)


def _verify(capsys, path: Path, *words: str) -> str:
    rc, err = run_cli(capsys, "verify", str(path))
    _one_line(rc, err, *words)
    return err


def _link_out(work: Path, name: str) -> Path:
    """``work/name`` replaced by a link to an identical copy outside the folder (its digest still matches)."""
    outside = work.parent / "elsewhere" / name
    outside.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(work / name, outside)
    (work / name).symlink_to(outside)
    return outside


def test_verify_takes_the_working_folder_and_refuses_what_is_no_folder_in_one_line(work, tmp_path, capsys,
                                                                                     monkeypatch):
    """`mpatch verify .` inside an output, an empty path (an unset variable) and a FIFO or a device were internal
    errors (the tools audit)."""
    monkeypatch.chdir(work)
    assert run_cli(capsys, "verify", ".")[0] == 0
    _one_line(*run_cli(capsys, "verify", ""), "the path is empty")
    os.mkfifo(tmp_path / "fifo")
    _verify(capsys, tmp_path / "fifo", f"{tmp_path / 'fifo'} is a FIFO, not an output folder or a manifest")
    _verify(capsys, Path("/dev/null"), "/dev/null is a character device, not an output folder or a manifest")


def test_verify_names_every_file_the_manifest_does_not_list(work, capsys):
    (work / "notes.txt").write_text("mine")
    (work / "release" / "extra.distcp").write_bytes(b"x")
    (work / "passwd").symlink_to("/etc/passwd")
    os.mkfifo(work / "pipe")
    _verify(capsys, work, "4 file(s) that mpatch_manifest.json does not list",
            "notes.txt", "passwd", "pipe", "release/extra.distcp")


def test_verify_counts_an_empty_folder_as_added_as_force_does(work, capsys):
    """verify said "every file is as written" of an output holding an empty folder its manifest does not list, which
    --force then refused as added after mpatch wrote it: the two agree now (docs/outputs.md)."""
    (work / "added_folder" / "deeper").mkdir(parents=True)
    _verify(capsys, work, "1 file(s) that mpatch_manifest.json does not list", "added_folder/deeper/")


def test_verify_names_listed_files_that_are_links_or_not_regular_files(work, capsys):
    sidecar, distcp = "mpatch_checkpoint.json", sorted(p.name for p in (work / "release").glob("*.distcp"))[0]
    _link_out(work, sidecar)
    os.replace(work / "release" / distcp, work / "release" / "saved")
    os.mkfifo(work / "release" / distcp)
    err = _verify(capsys, work, f"lists {sidecar}, which leads outside", f"lists release/{distcp}, which is a FIFO")
    assert "saved" in err  # the file moved aside is unlisted
    (work / "release" / distcp).unlink()
    (work / "release" / distcp).symlink_to(work / "release" / "saved")  # a link that stays inside is a link still
    _verify(capsys, work, f"lists release/{distcp}, which is a symlink (to {work / 'release' / 'saved'})")


def test_verify_of_a_run_names_every_iteration_no_manifest_vouches_for(work, tmp_path, capsys):
    """verify of a run (or checkpoint) folder checked the manifests it found and said 'every file is as written',
    while an iteration without one (the newest, damaged) went unchecked. A partial folder (a save that did not
    finish, which nothing reads) is not an iteration; a conversion's release/ is its parent's manifest's."""
    run = tmp_path / "run"
    for i in (2, 4):
        iteration = run / "checkpoint" / f"iter_{i:07d}"
        shutil.copytree(work / "release", iteration)
        write_manifest(iteration, "mpatch train", sync=False)
    partial = run / "checkpoint" / ".iter_0000006.mpatch-partial.1234"
    partial.mkdir()
    (partial / "common.pt").write_bytes(b"half")
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("4")
    assert run_cli(capsys, "verify", str(run))[0] == 0
    # the iteration the tracker names is the run's newest checkpoint: gone (or a tracker edited), it was not said
    # (the tools audit)
    for named in ("6", "999"):
        (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text(named)
        for path in (run, run / "checkpoint"):
            _verify(capsys, path, f"latest_checkpointed_iteration.txt names iteration {named}, but "
                                  f"iter_{int(named):07d} is missing")
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("4")
    (run / "checkpoint" / "iter_0000004" / MANIFEST_NAME).unlink()
    for path in (run, run / "checkpoint"):
        _verify(capsys, path, f"{run / 'checkpoint' / 'iter_0000004'} has no {MANIFEST_NAME}", "nothing vouches")
    shutil.rmtree(run / "checkpoint" / "iter_0000004")
    (run / "checkpoint" / "latest_checkpointed_iteration.txt").write_text("2")
    (run / "checkpoint" / "iter_0000008").mkdir()  # a folder begun by hand or by another tool
    (run / "checkpoint" / "iter_0000008" / "common.pt").write_bytes(b"x")
    _verify(capsys, run, "iter_0000008 has no")
    models = tmp_path / "models"
    shutil.copytree(work, models / "ck")
    assert run_cli(capsys, "verify", str(models))[0] == 0


def test_verify_refuses_a_listed_folder_reached_through_a_link(work, capsys):
    _link_out(work, "release")
    _verify(capsys, work, "lists release/", "which leads outside")


def test_verify_refuses_an_empty_manifest(work, capsys):
    manifest = json.loads((work / MANIFEST_NAME).read_text())
    (work / MANIFEST_NAME).write_text(json.dumps({**manifest, "files": {}}))
    _verify(capsys, work, "lists no files, so it vouches for nothing")


@pytest.mark.parametrize("spelling", ["./{}", "{}/", "release//{}"])
def test_verify_refuses_a_file_listed_under_another_spelling(work, capsys, spelling):
    """"./release/common.pt" beside "release/common.pt": one file listed twice verified (the tools audit)."""
    manifest = json.loads((work / MANIFEST_NAME).read_text())
    name = next(n for n in manifest["files"] if n.startswith("release/"))
    other = spelling.format(name if not spelling.startswith("release//") else name.removeprefix("release/"))
    (work / MANIFEST_NAME).write_text(json.dumps({**manifest, "files": {**manifest["files"],
                                                                        other: manifest["files"][name]}}))
    _verify(capsys, work, "has a malformed entry")


def test_verify_refuses_a_run_folder_whose_iterations_lie_elsewhere(work, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").symlink_to(work)
    _verify(capsys, run, "leads outside", "through a symlink")


def test_the_hub_cache_layout_of_an_output_verifies(work, tmp_path, capsys):
    snapshot, blobs = tmp_path / "models--x" / "snapshots" / "abc", tmp_path / "models--x" / "blobs"
    blobs.mkdir(parents=True)
    for i, p in enumerate(sorted(q for q in work.rglob("*") if q.is_file())):
        os.link(p, blobs / f"blob{i}")
        (snapshot / p.relative_to(work)).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / p.relative_to(work)).symlink_to(blobs / f"blob{i}")
    rc, err = run_cli(capsys, "verify", str(snapshot))
    assert rc == 0, err


def test_mcore2hf_does_not_read_through_a_listed_link(work, tmp_path, capsys):
    distcp = sorted(p.name for p in (work / "release").glob("*.distcp"))[0]
    _link_out(work, f"release/{distcp}")
    out = tmp_path / "hf_out"
    rc, err = run_cli(capsys, "convert", "mcore2hf", "--load-dir", str(work), "--save-dir", str(out), "--quiet")
    _one_line(rc, err, f"{distcp} leads outside the folder")  # found by the look, before the manifest's check
    assert not out.exists() and not leftovers(out)


def test_loads_for_training_and_align_apply_the_same_rules(work):
    from megatron_patch.checkpoint.loading import verify_before_load

    (work / "release" / "planted.pt").write_bytes(b"x")
    with pytest.raises(IntegrityError, match="does not list .added after mpatch wrote it.: release/planted.pt"):
        verify_before_load(work / "release")


def test_a_data_prefix_manifest_covers_its_bin_and_idx(tmp_path, capsys):
    from tests.training_helpers import make_tiktoken_file, write_jsonl

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"doc {i}"} for i in range(5)])
    tok = make_tiktoken_file(tmp_path / "tok.tiktoken", [])
    assert run_cli(capsys, "preprocess", "--input", str(data), "--output-prefix", str(tmp_path / "p"),
                   "--tokenizer", str(tok), "--quiet")[0] == 0
    manifest = tmp_path / f"p_text_document.{MANIFEST_NAME}"
    # named by its prefix, as DATASET_PATH and every other command name it ("does not exist" before)
    assert main(["verify", str(tmp_path / "p_text_document")]) == 0
    assert "verified 1 manifest(s)" in capsys.readouterr().out
    raw = json.loads(manifest.read_text())
    del raw["files"]["p_text_document.idx"]
    manifest.write_text(json.dumps(raw))
    for named in (manifest, tmp_path / "p_text_document"):
        _verify(capsys, named, "1 file(s) that p_text_document.mpatch_manifest.json does not list",
                "p_text_document.idx")


def _iteration_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "iter_0000002"
    folder.mkdir()
    for name in (".metadata", "__0_0.distcp", "common.pt", "train_state.json"):
        (folder / name).write_bytes(name.encode())
    return folder


def test_training_manifests_list_the_hidden_metadata(tmp_path, monkeypatch):
    """torch_dist's ``.metadata`` is what resume reads first; the manifest of a training save left hidden files out."""
    from megatron_patch.training import checkpointing

    folder = _iteration_folder(tmp_path)
    one_rank = SimpleNamespace(barrier=lambda: None, get_rank=lambda: 0, get_world_size=lambda: 1,
                               all_gather_object=lambda out, obj: out.__setitem__(0, obj))
    monkeypatch.setattr(checkpointing, "dist", one_rank)
    checkpointing._write_shared_manifest(folder, "mpatch train, iteration 2")
    assert ".metadata" in json.loads((folder / MANIFEST_NAME).read_text())["files"]


def test_a_training_iteration_saved_before_its_manifest_listed_metadata_still_reads(tmp_path):
    """A run folder saved before the change above still resumes: its ``.metadata`` is not counted as unlisted.
    Only training left it out: any other writer's manifest that does not list it is refused."""
    from megatron_patch.checkpoint_files.manifest import check_coverage, digests

    folder = _iteration_folder(tmp_path)
    older = digests(folder, ["__0_0.distcp", "common.pt", "train_state.json"], sync=False)
    write_manifest(folder, "mpatch train, iteration 2", files=older, sync=False)
    assert ".metadata" not in check_coverage(folder / MANIFEST_NAME)["files"]
    write_manifest(folder, "mpatch convert hf2mcore", files=older, sync=False)
    with pytest.raises(IntegrityError, match="does not list .added after mpatch wrote it.: .metadata"):
        check_coverage(folder / MANIFEST_NAME)
