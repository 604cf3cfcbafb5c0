"""The notebook %dist_reproduce writes (services/cases/reproduce.py), and each way its input can be bad.
The end-to-end run of such a notebook, from a real hung job, is in tests/e2e/test_attach_e2e.py."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from distnb.services.cases.reproduce import JobFacts, job_env, write_reproduction

SCRIPT = '''import torch.distributed as dist


def main():
    dist.init_process_group("gloo")
    t = compute()
    dist.all_reduce(t)
    print("done")


if __name__ == "__main__":
    main()
'''


def _facts(tmp_path: Path, **kw: object) -> JobFacts:
    (tmp_path / "train.py").write_text(SCRIPT)
    base = dict(world_size=8, argv=("train.py", "--lr", "0.1"), cwd=str(tmp_path), backend="gloo",
                env={"NCCL_DEBUG": "INFO", "RANK": "3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "TORCH_SHOW_CPP_STACKTRACES": "1"},
                site=7, failure="rank 3 raised ValueError", hung=False, job="j1")
    base.update(kw)
    return JobFacts(**base)  # type: ignore[arg-type]


def test_the_notebook_launches_the_job_size_sets_up_as_torchrun_and_ends_at_the_failing_call(tmp_path: Path) -> None:
    made = write_reproduction(_facts(tmp_path), tmp_path / "r.ipynb")
    nb = nbformat.read(made.path, as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    assert code[0] == "%load_ext distnb\n%dist_launch -n 8 --backend gloo --env NCCL_DEBUG=INFO --env TORCH_SHOW_CPP_STACKTRACES=1"
    assert f"sys.argv = [{str(tmp_path / 'train.py')!r}, '--lr', '0.1']" in code[1] and f"os.chdir({str(tmp_path)!r})" in code[1]
    assert code[-2] == "%%on_ranks\ndist.all_reduce(t)" and nb.cells[-3].metadata["tags"] == ["raises-exception"]
    assert code[-3] == '%%on_ranks\ndist.init_process_group("gloo")\nt = compute()' and code[-1] == "%dist_shutdown"
    assert 'print("done")' in nb.cells[-1].source and nb.cells[-1].cell_type == "markdown"
    assert "rank 3 raised ValueError" in nb.cells[0].source and "line 7 of `train.py`" in nb.cells[0].source
    assert made.failing == "dist.all_reduce(t)" and "in 3 cells on a pool of 8 ranks" in made.text()


def test_a_hung_job_bounds_its_failing_cell(tmp_path: Path) -> None:
    made = write_reproduction(_facts(tmp_path, hung=True), tmp_path / "r.ipynb", hung_timeout=12)
    code = [c.source for c in nbformat.read(made.path, as_version=4).cells if c.cell_type == "code"]
    assert code[-2] == "%%on_ranks --timeout 12\ndist.all_reduce(t)"


def test_without_a_site_every_cell_is_there(tmp_path: Path) -> None:
    made = write_reproduction(_facts(tmp_path, site=None), tmp_path / "r.ipynb")
    nb = nbformat.read(made.path, as_version=4)
    assert made.failing is None and not any(c.metadata.get("tags") for c in nb.cells)
    assert "No line of the script stood out" in nb.cells[0].source and "main()" in nb.cells[-2].source


def test_fewer_ranks_hold_the_blamed_ones_and_say_the_job_had_more(tmp_path: Path) -> None:
    made = write_reproduction(_facts(tmp_path, culprits=(3,)), tmp_path / "r.ipynb")
    assert made.world_size == 8 and made.fewest == 4 and "--ranks 4 may fail the same way (likely, not certain" in made.text()
    small = write_reproduction(_facts(tmp_path, culprits=(3,)), tmp_path / "s.ipynb", ranks=4)
    nb = nbformat.read(small.path, as_version=4)
    assert nb.cells[1].source.startswith("%load_ext distnb\n%dist_launch -n 4 --backend gloo")
    assert "This pool has 4 of the job's 8 ranks" in nb.cells[0].source
    assert "on a pool of 4 ranks (the job had 8: check that it fails the same way)" in small.text() and "fewer ranks:" not in small.text()
    # Rank 0 alone blamed: three ranks, so that the others are a majority that can blame it again.
    assert write_reproduction(_facts(tmp_path, culprits=(0,)), tmp_path / "t.ipynb").fewest == 3
    assert write_reproduction(_facts(tmp_path, culprits=(0, 1)), tmp_path / "t.ipynb").fewest == 5
    with pytest.raises(ValueError, match="the failure is rank 3's, which a pool of 3 ranks does not have; give at least 4"):
        write_reproduction(_facts(tmp_path, culprits=(1, 3)), tmp_path / "u.ipynb", ranks=3)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"--ranks {bad}: give 1 to the job's world size, 8"):
            write_reproduction(_facts(tmp_path), tmp_path / "v.ipynb", ranks=bad)


def test_only_settings_survive_the_environment() -> None:
    assert job_env({"RANK": "1", "LOCAL_RANK": "1", "NCCL_IB_DISABLE": "1", "DISTNB_ATTACH": "1", "TORCHELASTIC_MAX_RESTARTS": "0",
                    "OMP_NUM_THREADS": "4", "TORCH_FR_BUFFER_SIZE": "500"}) == {"NCCL_IB_DISABLE": "1", "OMP_NUM_THREADS": "4"}


@pytest.mark.parametrize(("kw", "message"), [
    ({"argv": ("-c",)}, "no script file to cut into cells"),
    ({"argv": ()}, "no script file"),
    ({"argv": ("gone.py",)}, "is not on this machine: run %dist_reproduce where the job ran"),
    ({"world_size": 0}, "world size is 0"),
])
def test_bad_inputs_say_what_to_do(tmp_path: Path, kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        write_reproduction(_facts(tmp_path, **kw), tmp_path / "r.ipynb")


def test_a_script_that_does_not_parse_here(tmp_path: Path) -> None:
    facts = _facts(tmp_path)
    (tmp_path / "train.py").write_text("match x:\n  case:\n")
    with pytest.raises(ValueError, match=r"train.py does not parse here .*line 2.*this Python is not the job's"):
        write_reproduction(facts, tmp_path / "r.ipynb")
