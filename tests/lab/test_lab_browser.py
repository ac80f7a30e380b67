"""The notebooks as a person uses them: JupyterLab in Debian's Chromium, driven by Playwright.

JupyterLab runs headless on localhost (a random free port, a token), started
the way `make lab` starts it (cflib.lab: the `cflib` kernel only). Each
notebook of SMOKE_RUNS is copied with its smoke parameters injected as
papermill would inject them, opened, run with Run > Run All Cells, and checked
once the kernel is idle: every code cell ran, a progress widget rendered, a plot
image exists, no cell shows an error (on the page and in the saved notebook).
Each run is as small as still shows all of that (nbval runs every notebook at
its defaults); compare_runs' files and evaluate's record are read back after
their runs, and measure_throughput's and tune_microbatch's records, in place of papermill runs of their own.
A screenshot of the whole notebook lands in outputs/lab/ (`make screenshots`
copies them to outputs/screenshots/, which the README shows). JupyterLab is
shut down through its API, and no process it or the browser started may be
left running.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook
from playwright.sync_api import Browser, Page, expect, sync_playwright

from cflib.lab.jupyter import lab_command
from cflib.train.params import load_params_file

try:
    import sft_shard_helpers as h
    from processes import descendants, still_running
    from tiny_models import trained_model
except ImportError:
    from tests import sft_shard_helpers as h
    from tests.processes import descendants, still_running
    from tests.tiny_models import trained_model

pytestmark = pytest.mark.slow  # JupyterLab and a browser: make test runs it, make test-fast leaves it out

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = ROOT / "outputs" / "lab"

# Adding a notebook is one line: its smoke parameters (a params file or None for the notebook's
# defaults, then values over it; "{tmp}" is this test's own folder, so runs write nothing into outputs/, and
# "{checkpoint}" a small model trained by this test). The page is what is checked here: every cell runs on the
# cflib kernel and renders its widgets, progress and plots. So each run is as small as still shows all of that;
# the notebooks' numbers at their defaults are nbval's (every notebook), papermill's (tests/lab) and tests/bench's.
SMOKE_RUNS = {
    "train_sft.ipynb": ("params/smoke.yaml", {"out_dir": "{tmp}/train_sft-run", "max_steps": 6,
                                              "exact_match_limit": 8}),
    "validate_kernels.ipynb": (None, {"out_dir": "{tmp}/validate_kernels-run", "dtypes": "float32"}),
    # params/tune_smoke.yaml (the notebook's defaults), its exhaustive sweep included (its record and the params
    # file train_sft takes: test_tune_microbatch_...).
    "tune_microbatch.ipynb": ("params/tune_smoke.yaml", {"out_dir": "{tmp}/tune-run/tune"}),
    # params/throughput_smoke.yaml at one micro-batch: the project's path and peers on each kind of batches, one
    # of them (Liger's) skipped on the CPU (its record and table: test_measure_throughput_...).
    "measure_throughput.ipynb": ("params/throughput_smoke.yaml", {
        "out_dir": "{tmp}/throughput-run", "micro_batches": [2],
        "paths": ["reference", "peer_eager", "peer_liger", "peer_padded"]}),
    # Trains its model here (the loss plot), a few steps.
    "chat.ipynb": (None, {"out_dir": "{tmp}/chat-run", "train_steps": 4, "max_new_tokens": 8,
                          "prompts": ["123+456=", "upper python"]}),
    # One real point of two steps (each point is a papermill run of train_sft): the live table, then the
    # comparison's plots.
    "sweep.ipynb": (None, {"out_dir": "{tmp}/sweep-run",
                           "grid": {"lr": [0.003], "max_steps": [2], "eval_every_steps": [2],
                                    "save_every_steps": [None], "exact_match_limit": [4]}}),
    # The committed sweep against another metric than the default (the files it writes: test_compare_runs_...).
    "compare_runs.ipynb": (None, {"out_dir": "{tmp}/compare-run", "metric": "exact_match/overall"}),
    # A checkpoint exported to a bundle here, one shipped task, a few examples (its record: test_evaluate_...).
    "evaluate.ipynb": (None, {"out_dir": "{tmp}/evaluate-run", "model": "{checkpoint}", "tasks": "embedded_choice",
                              "limit": 6}),
}

# Bounds for a loaded 2-core CI machine; each names what it waited for when it runs out.
SERVER_START_S = 120
KERNEL_READY_S = 120
RUN_ALL_S = 480
# What the page shows after a click or a keystroke comes from the kernel: allow a loaded machine time.
expect.set_options(timeout=30_000)
# Chromium as the machine allows it: no sandbox as root, no GPU, no calls home on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# This test's JupyterLab user settings: no news prompt over the page, no autosave racing the
# test's own save, every cell in the page (not only those in view) and no blank space after the
# last one, for the full-length screenshot.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "scrollPastEnd": False},
}


@dataclass
class Lab:
    url: str
    token: str
    root: Path  # JupyterLab's root: the test's copies of the notebooks
    tmp: Path
    log: Path
    browser: Browser
    executed: dict[str, Page] = field(default_factory=dict)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _api(lab_url: str, token: str, path: str, method: str = "GET") -> bytes:
    request = urllib.request.Request(f"{lab_url}{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def _wait_for_server(process: subprocess.Popen, url: str, token: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {process.returncode} while starting:\n{log.read_text()[-3000:]}")
        try:
            _api(url, token, "/api/status")
            return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer on {url} within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


def _shut_down(process: subprocess.Popen, url: str, token: str) -> str | None:
    """Stop JupyterLab through its API (it stops its kernels first); force it only if that fails."""
    try:
        _api(url, token, "/api/shutdown", method="POST")
        process.wait(timeout=60)
        return None
    except (OSError, subprocess.TimeoutExpired) as err:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"JupyterLab did not shut down through /api/shutdown ({err}); it was killed"


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    if not CHROMIUM.exists():
        message = f"{CHROMIUM} is missing: `apt-get install chromium` (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run this test, never skip it
        pytest.skip(message)
    tmp = tmp_path_factory.mktemp("lab")
    root = tmp / "notebooks"
    root.mkdir()
    for name, settings in LAB_SETTINGS.items():
        path = tmp / "settings" / f"{name}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings))
    port, token = _free_port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    command = lab_command(root, "", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
                          "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
                          f"--LabApp.user_settings_dir={tmp / 'settings'}",
                          f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
                          "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate")
    # Nothing from this machine's own Jupyter configuration or runtime folder.
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "config"), "JUPYTER_RUNTIME_DIR": str(tmp / "runtime")}
    log = tmp / "lab.log"
    already_running = descendants(os.getpid())
    started: set[int] = set()
    problems: list[str] = []
    with open(log, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        _wait_for_server(process, url, token, log)
        with ExitStack() as stack:
            playwright = stack.enter_context(sync_playwright())
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
            stack.callback(browser.close)
            try:
                yield Lab(url, token, root, tmp, log, browser)
            finally:
                # Everything started for this test: JupyterLab, its kernels and whatever they ran,
                # Playwright's driver and Chromium's processes.
                started = descendants(os.getpid()) - already_running
    finally:
        started |= descendants(process.pid) | {process.pid}
        if process.poll() is None:
            problem = _shut_down(process, url, token)
            if problem:
                problems.append(problem)
        left = still_running(started, timeout_s=30)
        for pid in left:
            try:
                problems.append(f"left running: pid {pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    assert not problems, "\n".join(problems)


def _smoke_notebook(lab: Lab, name: str) -> Path:
    """The notebook with its smoke parameters injected as papermill injects them, in JupyterLab's root."""
    params_file, overrides = SMOKE_RUNS[name]
    parameters = {**(load_params_file(ROOT / params_file) if params_file else {}),
                  **{key: value.format(tmp=lab.tmp, checkpoint=_checkpoint(lab) if "{checkpoint}" in value else "")
                     if isinstance(value, str) else value for key, value in overrides.items()}}
    notebook = parameterize_notebook(load_notebook_node(str(ROOT / "notebooks" / name)), parameters)
    path = lab.root / name
    nbformat.write(notebook, path)
    return path


def _checkpoint(lab: Lab) -> Path:
    """A small model trained on chat examples for a few seconds, for the notebooks given a model."""
    from cflib.model import save_checkpoint

    path = lab.tmp / "small-model" / "best"
    if not path.is_dir():
        save_checkpoint(trained_model([e.input_ids for e in h.chat_examples()], h.VOCAB, steps=25), path)
    return path


PROMPTS_JS = "() => [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]" \
             ".map(e => e.textContent.trim())"
# Run All queues every cell: a cell shows [*] until it has run, [n] once it has, [ ] if never reached.
FINISHED_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')]
    .map(e => e.textContent.trim());
  const status = document.querySelector('.jp-Notebook-ExecutionIndicator')?.getAttribute('data-status');
  return prompts.some(p => /^\\[\\d+\\]:$/.test(p)) && !prompts.includes('[*]:') && status === 'idle';
}"""
TRACEBACKS_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-OutputArea-output')]
  .map(e => e.textContent).filter(t => t.includes('Traceback (most recent call last)'))"""
# JupyterLab 4 scrolls a notebook inside .jp-WindowedPanel-outer, not the page.
SCROLL_TO_TOP_JS = """() => {
  const outer = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
  outer.scrollTop = 0;
  return outer.scrollHeight - outer.clientHeight;
}"""
IMAGES_JS = """() => [...document.querySelectorAll('.jp-Notebook .jp-RenderedImage img')]
  .map(img => img.complete ? img.naturalWidth : 0)"""


def _menu(page: Page, menu: str, item: str) -> None:
    page.locator(".lm-MenuBar-itemLabel", has_text=re.compile(f"^{menu}$")).click()
    page.locator(".lm-Menu-itemLabel", has_text=re.compile(f"^{re.escape(item)}$")).click()


def _wait_kernel_idle(page: Page, lab: Lab, what: str) -> None:
    try:
        expect(page.get_by_text("cflib | Idle")).to_be_visible(timeout=KERNEL_READY_S * 1000)
    except AssertionError:
        shot = SCREENSHOTS / "failed-kernel.png"
        page.screenshot(path=shot)
        pytest.fail(f"{what}: the cflib kernel was not idle within {KERNEL_READY_S} s (screenshot {shot}); "
                    f"JupyterLab log:\n{lab.log_tail()}")


def _run_until_idle(page: Page, lab: Lab, name: str) -> None:
    try:
        page.wait_for_function(FINISHED_JS, timeout=RUN_ALL_S * 1000, polling=500)
    except Exception as err:  # Playwright's TimeoutError
        shot = SCREENSHOTS / f"failed-{Path(name).stem}.png"
        page.screenshot(path=shot, full_page=True)
        pytest.fail(f"{name}: cells still running after {RUN_ALL_S} s ({err.__class__.__name__}); prompts "
                    f"{page.evaluate(PROMPTS_JS)}; screenshot {shot}; JupyterLab log:\n{lab.log_tail()}")


def run_notebook(lab: Lab, name: str) -> Page:
    """Open the smoke copy of `name`, Run All Cells, wait for the kernel to go idle (once per notebook)."""
    if name in lab.executed:
        return lab.executed[name]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    _smoke_notebook(lab, name)
    page = lab.browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    # A workspace of its own, reset: JupyterLab would otherwise restore the notebooks other pages opened.
    workspace = Path(name).stem.replace("_", "-")
    page.goto(f"{lab.url}/lab/workspaces/{workspace}/tree/{name}?reset&token={lab.token}")
    _wait_kernel_idle(page, lab, name)
    _menu(page, "Run", "Run All Cells")
    _run_until_idle(page, lab, name)
    lab.executed[name] = page
    return page


def save_and_read(page: Page, lab: Lab, name: str) -> nbformat.NotebookNode:
    """Save the notebook from the browser (Ctrl+S) and read what JupyterLab wrote.

    Jupyter's server writes a notebook in place (its backup copy beside it), so a read while a save is writing
    finds a truncated file: the read waits for the file this save wrote, whole."""
    path = lab.root / name
    before = path.stat().st_mtime_ns
    page.locator(".jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.keyboard.press("Escape")
    page.keyboard.press("Control+s")
    expect(page.locator(".jp-mod-dirty")).to_have_count(0, timeout=30_000)
    deadline = time.monotonic() + 30
    while True:
        try:
            if path.stat().st_mtime_ns != before:
                return nbformat.read(path, as_version=4)
        except nbformat.reader.NotJSONError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: JupyterLab wrote no whole notebook within 30 s of Ctrl+S")
        time.sleep(0.2)


def screenshot(page: Page, name: str) -> Path:
    """The whole notebook in one image: the side bar folded, the window made as tall as the notebook."""
    left_tab = page.locator(".jp-SideBar.jp-mod-left .lm-TabBar-tab.lm-mod-current")
    if left_tab.count():
        left_tab.click()
    extra = page.evaluate(SCROLL_TO_TOP_JS)  # the notebook's hidden height
    page.set_viewport_size({"width": 1400, "height": min(1000 + extra, 16_000)})
    page.wait_for_timeout(500)  # one layout pass at the new size
    page.evaluate(SCROLL_TO_TOP_JS)
    path = SCREENSHOTS / f"{Path(name).stem}.png"
    page.screenshot(path=path)
    page.set_viewport_size({"width": 1400, "height": 1000})
    return path


@pytest.mark.parametrize("name", sorted(SMOKE_RUNS))
def test_notebook_runs_in_jupyterlab(lab, name):
    page = run_notebook(lab, name)
    prompts = page.evaluate(PROMPTS_JS)
    unrun = [index for index, prompt in enumerate(prompts) if not re.fullmatch(r"\[\d+\]:", prompt)]
    tracebacks = page.evaluate(TRACEBACKS_JS)
    assert not tracebacks, f"{name}: a cell shows an error:\n{tracebacks[0][-2000:]}"
    assert not unrun, f"{name}: code cells {unrun} never ran (prompts {prompts})"
    assert page.locator(".jp-Notebook .widget-hprogress").count() >= 1, \
        f"{name}: no progress widget rendered (tqdm.auto needs ipywidgets in the kernel's environment)"
    widths = page.evaluate(IMAGES_JS)
    assert widths and all(width > 0 for width in widths), f"{name}: no plot image rendered (widths {widths})"
    expect(page.locator(".jp-Toolbar-kernelName")).to_have_text("cflib")
    path = screenshot(page, name)
    assert path.stat().st_size > 10_000, f"{path}: suspiciously small screenshot"

    saved = save_and_read(page, lab, name)
    code = [cell for cell in saved.cells if cell.cell_type == "code"]
    assert all(cell.execution_count for cell in code), f"{name}: the saved notebook has unexecuted cells"
    errors = [o for cell in code for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"{name}: saved notebook holds an error: {errors[0].get('ename')}: {errors[0].get('evalue')}"


def test_train_form_follows_typing_and_reruns_the_notebook(lab):
    """Edit the main parameters in the form, see the arithmetic follow, Apply, run the cells below."""
    name = "train_sft.ipynb"
    page = run_notebook(lab, name)
    form = page.locator(".cflib-parameter-form")
    expect(form).to_be_visible()
    arithmetic = form.locator(".cflib-arithmetic")
    expect(arithmetic).to_contain_text("accumulation     2 = global 32 / (micro 16 x world 1)")

    def field(parameter: str):
        return form.locator(".widget-text", has=page.get_by_text(parameter, exact=True)).locator("input")

    field("micro_batch_per_rank").fill("8")
    expect(arithmetic).to_contain_text("accumulation     4 = global 32 / (micro 8 x world 1)")
    field("micro_batch_per_rank").fill("7")
    expect(form.locator(".cflib-form-error")).to_contain_text("micro_batch_per_rank in [2, 4, 8]")
    expect(form.get_by_role("button", name="Apply")).to_be_disabled()

    form.locator("select").select_option(label="params/quickstart.yaml")
    expect(arithmetic).to_contain_text("steps per epoch  344 (22,000 train examples / global 64)")
    form.locator("select").select_option(label="params/smoke.yaml")
    expect(arithmetic).to_contain_text("steps per epoch  688")
    rerun = lab.tmp / "form-run"
    field("max_steps").fill("2")
    field("out_dir").fill(str(rerun))
    form.get_by_role("button", name="Apply").click()
    expect(form.locator(".cflib-form-applied")).to_contain_text("max_steps=2")

    # The first cell below the form, then Run > Run Selected Cell and All Below.
    page.locator(".jp-MarkdownCell", has_text="Check everything before training").click()
    _menu(page, "Run", "Run Selected Cell and All Below")
    expect(page.locator(".jp-OutputArea-output", has_text=f"out_dir            {rerun}")).to_be_visible(
        timeout=RUN_ALL_S * 1000)
    _run_until_idle(page, lab, name)
    record = json.loads((rerun / "record.json").read_text())
    assert record["schedule"]["steps_done"] == 2 and record["micro_batch_per_rank"] == 16


COMMITTED_SWEEP = ROOT / "outputs" / "records" / "sweep_lr_seeds_cpu"


def test_compare_runs_writes_the_comparison_of_the_committed_sweep(lab):
    """compare_runs' run above, its files read back: a row per run, its numbers those of the runs' records."""
    run_notebook(lab, "compare_runs.ipynb")
    out_dir = lab.tmp / "compare-run"
    saved = json.loads((out_dir / "comparison.json").read_text())
    assert [row["run"] for row in saved["rows"]] == ["lr-0.003_seed-0", "lr-0.003_seed-1", "lr-0.01_seed-0",
                                                     "lr-0.01_seed-1"]
    assert saved["differing"] == ["seed", "lr"] and saved["metric"] == "exact_match/overall"
    for row in saved["rows"]:
        record = json.loads((COMMITTED_SWEEP / "runs" / row["run"] / "record.json").read_text())
        assert row["final_eval_loss"] == record["eval"]["final"]["loss"]
        assert row["exact_match/uppercase"] == record["eval"]["final"]["exact_match"]["uppercase"]
        assert row["tokens_per_s"] == record["throughput"]["steady_state_tokens_per_s"]
    header = (out_dir / "comparison.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["run", "seed", "lr"] and "kernel_path" in header
    assert {"loss_curves.png", "exact_match.png", "sweep.png"} <= {p.name for p in out_dir.iterdir()}


def test_evaluate_scores_the_bundle_of_the_checkpoint_it_was_given(lab):
    """evaluate's run above, its record read back: the checkpoint exported to a bundle, scored by lm-eval on
    `limit` examples of one shipped task, each choice's log-likelihood checked against cflib's; nothing trained."""
    run_notebook(lab, "evaluate.ipynb")
    out_dir = lab.tmp / "evaluate-run"
    record = json.loads((out_dir / "record.json").read_text())
    assert record["model"]["source"] == f"the Hub bundle of checkpoint {_checkpoint(lab)}, exported here"
    assert [row["metric"] for row in record["scores"]] == ["acc", "acc_norm"]
    assert record["scores"][0]["samples"] == 6 and record["settings"]["limit"] == 6
    assert record["loglikelihood_check"]["pairs"] == 24 and record["loglikelihood_check"]["max_abs_diff"] < 1e-4
    assert (out_dir / "lm_eval_results.json").is_file() and (out_dir / "scores.png").is_file()
    assert not (out_dir / "trained-here").exists()  # a model was named: nothing trained


def test_measure_throughput_records_every_path_and_shows_its_table_and_chart(lab):
    """measure_throughput's run above, on params/throughput_smoke.yaml: the saved notebook holds the bar chart and
    the table's rows, the record each path's status on each kind of batches (Liger's needs CUDA: skipped)."""
    name = "measure_throughput.ipynb"
    saved = save_and_read(run_notebook(lab, name), lab, name)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the bar chart
    assert any("| peer_eager | 2 |" in o.get("data", {}).get("text/markdown", "") for o in outputs)
    assert any("| peer_padded | 2 |" in o.get("data", {}).get("text/markdown", "") for o in outputs)
    out_dir = lab.tmp / "throughput-run"
    record = json.loads((out_dir / "record.json").read_text())
    assert [(e["batches"], e["path"], e["status"]) for e in record["paths"]] == [
        ("random_rows", "reference", "ok"), ("random_rows", "peer_eager", "ok"),
        ("random_rows", "peer_liger", "skipped"), ("realistic", "reference", "ok"), ("realistic", "peer_padded", "ok")]
    assert (out_dir / "throughput.png").is_file()


def test_tune_microbatch_writes_a_record_and_a_params_file_train_sft_trains_from(lab):
    """tune_microbatch's run above, on params/tune_smoke.yaml: the search checked against the exhaustive sweep,
    the linear fit near the answer, and the params file it writes taken by train_sft."""
    import papermill

    from cflib.train import train
    from cflib.train.params import TrainParams

    name = "tune_microbatch.ipynb"
    saved = save_and_read(run_notebook(lab, name), lab, name)
    outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)
    out_dir = lab.tmp / "tune-run" / "tune"
    record = json.loads((out_dir / "record.json").read_text())
    assert (out_dir / "memory_vs_microbatch.png").stat().st_size > 0
    assert sorted(entry.name for entry in out_dir.iterdir()) == ["memory_vs_microbatch.png", "record.json",
                                                                "train_sft_params.yaml"]  # the probe shard gone
    assert sorted(entry.name for entry in out_dir.parent.iterdir()) == ["tune"]  # nothing beside it
    assert record["search"]["probes_used"] <= 4
    sweep = record["sweep"]
    assert sweep["tuned_within_one"] and sweep["largest_fitting"] >= record["tuned_micro_batch_per_rank"]
    assert record["verification"]["peak_bytes"] <= record["budget"]["usable_bytes"]
    # Near the answer the line predicts what the sweep measured within 2%.
    fit = record["fit"]
    for probe in sweep["probes"]:
        if probe["peak_bytes"] is not None and abs(probe["micro"] - record["tuned_micro_batch_per_rank"]) <= 2:
            predicted = fit["intercept_bytes"] + fit["slope_bytes_per_example"] * probe["micro"]
            assert abs(probe["peak_bytes"] - predicted) <= 0.02 * predicted
    assert any(p["outcome"] == "out_of_memory" for p in sweep["probes"])  # the sweep ran into the cap
    batch = record["batch"]
    assert batch["micro_batch_per_rank"] * batch["world_size"] * batch["grad_accum"] == batch["global_batch"] == 64

    tuned = load_params_file(out_dir / "train_sft_params.yaml")
    params = TrainParams.from_dict(tuned)
    assert params.micro_batch_per_rank == batch["micro_batch_per_rank"] and params.seq_len == 64
    # Every name the file sets is a parameter of train_sft.ipynb (papermill -f injects them there), and the run
    # the notebook starts from them trains (the notebook's own run under papermill: tests/lab/test_notebooks.py).
    assert set(tuned) <= set(papermill.inspect_notebook(str(ROOT / "notebooks" / "train_sft.ipynb")))
    trained = train({**tuned, "out_dir": str(lab.tmp / "tuned-run"), "max_steps": 2, "exact_match_limit": 0},
                    progress=False)
    assert trained["micro_batch_per_rank"] == batch["micro_batch_per_rank"]
    assert trained["grad_accum"] == batch["grad_accum"]


MODEL_CARD = ROOT / "outputs" / "records" / "model_card_quickstart.md"


def test_the_model_card_renders_as_the_hub_shows_it(lab):
    """The committed card of a quickstart run, its metadata as huggingface_hub parses it over the body rendered
    from Markdown (tables on, as the Hub renders cards), in Chromium: the evaluation table and the loading lines
    show, and a screenshot of it lands beside the notebooks' (outputs/screenshots/model_card.png)."""
    import html

    from huggingface_hub import ModelCard
    from markdown_it import MarkdownIt

    card = ModelCard.load(MODEL_CARD)
    meta = card.data.to_dict()
    page = lab.browser.new_page(viewport={"width": 1000, "height": 800})
    try:
        metadata = html.escape("\n".join(card.data.to_yaml().splitlines()[:16]))  # its first lines, folded
        body_html = MarkdownIt("commonmark").enable("table").render(card.text)
        page.set_content("<html><body style='font-family: sans-serif; max-width: 900px; margin: 24px'>"
                         f"<pre id='metadata' style='background: #f6f8fa; padding: 8px'>{metadata}\n...</pre>"
                         f"<article id='card'>{body_html}</article></body></html>")
        body = page.locator("#card")
        expect(body.locator("h1, h2, h3, h4").first).to_be_visible()
        evaluation = body.locator("table").first
        expect(evaluation).to_be_visible()
        assert "eval/loss" in evaluation.inner_text()
        assert "from_pretrained" in "".join(body.locator("pre code").all_inner_texts())
        assert meta["library_name"] == "transformers" and meta["cflib"]["checkpoint"]["name"] == "best"
        height = page.evaluate("() => document.body.scrollHeight")
        page.set_viewport_size({"width": 1000, "height": min(height + 48, 16_000)})
        path = SCREENSHOTS / "model_card.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=path)
        assert path.stat().st_size > 10_000, f"{path}: suspiciously small screenshot"
    finally:
        page.close()
