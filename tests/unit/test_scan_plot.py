"""`vllm-dedup scan --plot FILE.png`: a PNG written next to an unchanged report, for 2 to 30
models, the figures it draws taken from the report, and one clear line (exit 2) when it
cannot be written."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import cli, picture_size, run_cli
from vllm_dedup.scan.files import scan_model
from vllm_dedup.checkpoint.manifest import ManifestCache
from vllm_dedup.scan.plot import plot_data, short_labels
from vllm_dedup.scan.report import Report

def plot_ok(proc, png: Path) -> tuple[int, int]:
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"vllm-dedup scan: heatmap written to {png}"
    return picture_size(png)


def hardlinked_copies(model: Path, root: Path, n: int) -> list[Path]:
    """``n`` copies of the folder ``model`` whose files are hard links: same inode, so the
    manifest cache (keyed by device, inode, size, mtime and header) hashes the bytes once.
    The links are to a copy of this test's own: a link changes its file's ctime, and other
    tests scanning the fixture's files at that moment would see them change."""
    own = root / "minilm"
    shutil.copytree(model, own)
    copies = []
    for i in range(n):
        dest = root / f"minilm-copy-{i:02d}"
        dest.mkdir(parents=True)
        for f in own.iterdir():
            if f.is_file():
                os.link(f, dest / f.name)
        copies.append(dest)
    return copies


@pytest.mark.heavy
def test_plot_of_smollm2_and_its_variants_leaves_the_report_unchanged(smollm2, variants, tmp_path):
    models = [str(smollm2), *map(str, variants.values())]
    plain = run_cli("scan", *models, cache=tmp_path / "cache", check=True)
    png = tmp_path / "heatmap.png"
    plotted = cli("scan", "--plot", str(png), *models, cache=tmp_path / "cache")
    plot_ok(plotted, png)
    assert plotted.stdout == plain.stdout  # the text report is the same, the PNG comes in addition


def test_the_plotted_figures_are_the_reports(smollm2, variants, tmp_path):
    """The heatmap's matrix is the JSON report's pairs; each model's bar splits its bytes into
    content another model holds and content only it holds."""
    models = [smollm2, *variants.values()]
    data = json.loads(cli("scan", "--json", *map(str, models), cache=tmp_path, check=True).stdout)
    pairs = {(p["a"], p["b"]): p["shared_bytes"] for p in data["pairs"]}
    report = Report([scan_model(m, cache=ManifestCache(tmp_path), progress=False) for m in models])
    plotted = plot_data(report)
    n = len(models)
    for i in range(n):
        for j in range(i + 1, n):
            expected = pairs[(str(models[i]), str(models[j]))]
            assert plotted.pair_bytes[i][j] == plotted.pair_bytes[j][i] == expected
    assert plotted.model_bytes == [m["bytes"] for m in data["models"]]
    # Every variant is made from the base, so what a model shares with any other is what it
    # shares with the model it overlaps most: the largest entry of its row.
    for i in range(n):
        assert plotted.shared_bytes[i] == max(plotted.pair_bytes[i][j] for j in range(n) if j != i)
    kinds = list(variants)
    fp16 = 1 + kinds.index("fp16")
    assert plotted.shared_bytes[0] == plotted.model_bytes[0]  # renamed-resharded holds all of it
    assert plotted.shared_bytes[fp16] == 0 and plotted.only_bytes[fp16] == plotted.model_bytes[fp16]
    assert plotted.saved_bytes == data["saved_bytes"] and plotted.total_bytes == data["total_bytes"]
    # Labels: the index of the text report, then the folder name, whose end tells the variants apart.
    assert plotted.labels[0].startswith("[0] SmolLM2-135M")
    for i, kind in enumerate(kinds, start=1):
        assert plotted.labels[i].startswith(f"[{i}] SmolLM2-135M") and plotted.labels[i].endswith(kind)


def test_plot_of_2_and_of_30_models(minilm, smollm2, variants, tmp_path):
    cache = tmp_path / "cache"
    two = tmp_path / "two.png"
    w2, h2 = plot_ok(cli("scan", "--plot", str(two), str(smollm2), str(variants["last-layers"]), cache=cache),
                     two)
    copies = hardlinked_copies(minilm, tmp_path / "copies", 30)
    many = tmp_path / "many.png"
    proc = cli("scan", "--json", "--plot", str(many), *map(str, copies), cache=cache)
    w30, h30 = plot_ok(proc, many)
    assert w30 > w2 and h30 > h2  # the layout grows with the number of models
    data = json.loads(proc.stdout)  # --json still prints exactly one JSON object
    assert len(data["models"]) == 30
    # One inode, hashed once: the other 29 copies came from the manifest cache.
    assert [m["hashed_bytes"] > 0 for m in data["models"]] == [True] + [False] * 29
    assert data["unique_bytes"] == data["models"][0]["bytes"]


def test_model_paths_with_dollar_signs_are_drawn_as_they_are(minilm, tmp_path):
    """matplotlib reads text between two ``$`` as math: ``n$\\q$`` made it raise after the
    report was printed (exit 1, a traceback), ``price$5$tier`` was drawn as ``price5tier``."""
    from vllm_dedup.scan.plot import _draw_heatmap, _Layout

    copies = hardlinked_copies(minilm, tmp_path / "copies", 2)
    named = [c.rename(c.with_name(name)) for c, name in zip(copies, ["n$\\q$", "price$5$tier"])]
    png = tmp_path / "dollars.png"
    plot_ok(cli("scan", "--plot", str(png), *map(str, named), cache=tmp_path / "cache"), png)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = SimpleNamespace(labels=["[0] price$5$tier", "[1] n$\\q$"], pair_bytes=[[0, 1], [1, 0]])
    fig, ax = plt.subplots()
    _draw_heatmap(fig, ax, data, "MB", 1.0, _Layout.for_models(data.labels))
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()] == data.labels
    assert not any(t._parse_math for t in ax.get_yticklabels())
    plt.close(fig)


def test_short_labels_name_folders_and_tell_equal_names_apart():
    assert short_labels(["/m/llama", "/m/mistral.safetensors"]) == ["llama", "mistral.safetensors"]
    # Equal folder names get their parent.
    assert short_labels(["/a/x/model", "/a/y/model", "/b/other"]) == ["x/model", "y/model", "other"]
    # A Hugging Face hub snapshot is named by its repository.
    hub = "/h/hub/models--HuggingFaceTB--SmolLM2-135M/snapshots/0123abcd"
    assert short_labels([hub]) == ["HuggingFaceTB/SmolLM2-135M"]
    (long,) = short_labels(["/m/" + "a" * 20 + "-middle-" + "z" * 20])
    assert len(long) == 36 and long.startswith("a" * 17) and long.endswith("z" * 18) and "…" in long


def test_a_plot_that_cannot_be_written_is_one_clear_line_and_exit_2(minilm, tmp_path):
    cache = tmp_path / "cache"
    cases = {
        "missing folder": (tmp_path / "no-such-dir" / "x.png", "no such folder"),
        "a folder": (tmp_path, "Is a directory"),
    }
    for name, (target, words) in cases.items():
        proc = cli("scan", "--plot", str(target), str(minilm), cache=cache)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (name, proc.stderr)
        assert lines[0].startswith(f"vllm-dedup scan: error: cannot write the plot to {target}: "), (name, lines[0])
        assert words in lines[0], (name, lines[0])
    assert not (tmp_path / "no-such-dir").exists()


def test_without_matplotlib_the_error_names_the_extra(minilm, tmp_path, monkeypatch):
    """A ``matplotlib`` that cannot be imported (a stand-in first on the path) stops the scan
    before it starts, naming the extra to install."""
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    proc = run_cli("scan", "--plot", str(tmp_path / "x.png"), str(minilm), cache=tmp_path / "cache")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.strip() == ('vllm-dedup scan: error: --plot needs matplotlib, which is not installed: '
                                   'pip install "vllm-dedup[plot]"')
    assert not (tmp_path / "x.png").exists()
