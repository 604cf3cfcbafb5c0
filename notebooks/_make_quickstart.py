"""Builds notebooks/quickstart.ipynb (run: python notebooks/_make_quickstart.py).

The cells that fail on purpose (the error, the hang) carry Jupyter's ``raises-exception`` tag: a
failing ``%%on_ranks`` cell raises, which stops Run All, and the tag lets the tour run through."""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

RAISES = "raises-exception"

CELLS: list[tuple[str, ...]] = [
    ("md", "# distnb quickstart\n\nA persistent pool of torchrun ranks, driven cell by cell. Runs on a CPU (gloo)."),
    ("code", "%load_ext distnb\n%dist_launch -n 2 --backend gloo"),
    ("md", "Every rank runs the cell; its last expression is shown per rank, identical ones once."),
    ("code", "%%on_ranks\nx = torch.full((2,), float(rank) + 1)\ndist.all_reduce(x)\nx"),
    ("md", "Output streams back live, labelled by rank; identical lines appear once."),
    ("code", "%%on_ranks\nimport time\nprint('hello from the pool')\ntime.sleep(0.5)\nprint(f'rank {rank} of {world_size} on {device}')"),
    ("md", "An error on one rank: the traceback shows the cell's own line, grouped by rank."),
    ("code", "%%on_ranks\nif rank == 1:\n    raise ValueError(f'rank {rank} got a bad batch')\n'fine'", RAISES),
    ("md", "A hang, explained while it happens: rank 1 never joins the all_reduce."),
    ("code", "%%on_ranks --timeout 4 --hang-after 1\nx = torch.ones(2)\nif rank == 0:\n    dist.all_reduce(x)", RAISES),
    ("code", "%dist_stacks"),
    ("code", "%dist_collectives"),
    ("code", "%dist_restart"),
    ("md", "Move values between the notebook and the ranks."),
    ("code", "lr = 0.1\n%dist_push lr\n%dist_pull lr"),
    ("code", "%%on_ranks\nbuf = bytearray((200 << 20) if rank == 1 else 0)"),
    ("code", "%dist_memory --plot"),
    ("code", "%dist_status"),
    ("code", "%dist_shutdown"),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src, metadata={"tags": list(tags)} if tags else {})
                for kind, src, *tags in CELLS]
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating changes only what changed
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


if __name__ == "__main__":
    path = Path(__file__).with_name("quickstart.ipynb")
    nbformat.write(build(), str(path))
    print(f"wrote {path}")
