"""Fixtures shared by the serving tests: one tiny calibrated plan, built once per session.

The suite never touches the user's own state: :func:`pytest_configure` points ``STARONNX_HOME``
(perf models, shared weights) and ``TMPDIR`` at a private folder for the whole session, before
any test runs, and every subprocess inherits both. At the end :func:`pytest_sessionfinish`
fails the run when the real home (``$STARONNX_HOME`` as it was before pytest started, else
``~/.cache/staronnx``) changed, or when the suite left ``staronnx-*`` temporaries behind, then
removes the private folder. Only what this session made is looked at: other processes using
``/tmp`` or the real home meanwhile cannot make it fail.

Under pytest-xdist (``make test`` runs ``-n``), the controller makes the private folder and
each worker a home and a TMPDIR of its own inside it (``<private>/gw0/home``, ...), so tests in
different workers never share a store; the controller checks them all when the run ends.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import onnx
import pytest

from staronnx import partition
from staronnx.calibrate import calibrate, start_workers
from staronnx.perfmodels import PerfModelStore
from staronnx.plan import Plan
from staronnx.zoo import fragile, inception
from staronnx.partition import PartitionSpec
from staronnx.workers.layout import MachineSpec


@pytest.fixture(autouse=True)
def _sigint_not_ignored():
    """Each test starts with SIGINT handled as Python's default: a library an earlier test of
    the same (xdist) worker process started may have left it ignored, and a child process
    inherits an ignored SIGINT, so the Ctrl-C tests' commands would never see theirs."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield

#: the controller's private folder and the real home, handed to xdist workers (which inherit
#: the controller's environment, STARONNX_HOME already private)
PRIVATE_ENV, REAL_HOME_ENV = "STARONNX_TEST_PRIVATE", "STARONNX_TEST_REAL_HOME"
#: the controller's COLUMNS ("" where unset): an xdist worker finds COLUMNS=80 in its environment,
#: which the CLI's consoles (made at import) and every subprocess would take as the width
COLUMNS_ENV = "STARONNX_TEST_COLUMNS"
#: the store a user's commands write to, as it was before pytest changed STARONNX_HOME
REAL_HOME = Path(os.environ.get(REAL_HOME_ENV) or os.environ.get("STARONNX_HOME")
                 or Path.home() / ".cache" / "staronnx").expanduser()
#: names of the temporaries staronnx makes (tempfile.mkdtemp(prefix="staronnx-..."))
TEMP_PREFIX = "staronnx-"


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root``: relative path -> (size, mtime in ns) for a file,
    (-1, 0) for a folder (its mtime moves with its entries, which are listed); {} if absent."""
    out: dict[str, tuple[int, int]] = {}
    if not root.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            out[str(path.relative_to(root))] = (-1, 0) if path.is_dir() else (st.st_size, st.st_mtime_ns)
    return out


def _owner(relative: str) -> int | None:
    """The pid a ``weights/pid<N>-...`` entry names (each process that shares weights makes
    and removes its own such folder), else None."""
    m = re.match(r"^weights/pid([0-9]+)-", relative)
    return int(m[1]) if m else None


def live_owners(entries) -> set[int]:
    """The pids of ``weights/pid<N>-...`` entries that are alive now, this process left out."""
    pids = {pid for pid in map(_owner, entries) if pid is not None and pid != os.getpid()}
    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        except OSError:
            pass
        alive.add(pid)
    return alive


def home_changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]],
                 concurrent: set[int] = frozenset()) -> list[str]:
    """What changed between two :func:`snapshot` s: '+ path', '- path', '~ path'. The own
    folders of processes that are not the suite's are left out: ``concurrent`` (alive when the
    session started) and those still alive now (the suite's subprocesses are gone by then)."""
    changes = ([("+", p) for p in after.keys() - before.keys()]
               + [("-", p) for p in before.keys() - after.keys()]
               + [("~", p) for p in before.keys() & after.keys() if before[p] != after[p]])
    others = set(concurrent) | live_owners(p for _, p in changes)
    return sorted(f"{kind} {p}" for kind, p in changes if _owner(p) not in others)


def leaked_temporaries(tmp: Path) -> list[str]:
    """The ``staronnx-*`` entries left in a temporary folder."""
    return sorted(p.name for p in tmp.glob(f"{TEMP_PREFIX}*")) if tmp.is_dir() else []


def _use_private(root: Path) -> None:
    """Point STARONNX_HOME and TMPDIR at ``root/home`` and ``root/tmp`` (made here)."""
    (root / "home").mkdir(parents=True)
    (root / "tmp").mkdir()
    os.environ["STARONNX_HOME"] = str(root / "home")
    os.environ["TMPDIR"] = str(root / "tmp")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_configure(config: pytest.Config) -> None:
    """A private STARONNX_HOME and TMPDIR for the session (inherited by every subprocess)."""
    if getattr(config, "_staronnx_private", None) is not None:
        return
    # an xdist worker (the documented marker: config.workerinput) under a controller that made
    # the private folder: a home and temporaries of its own there, checked by the controller
    worker = getattr(config, "workerinput", {}).get("workerid")
    shared = os.environ.get(PRIVATE_ENV)
    if worker and shared and Path(shared).is_dir():
        _use_private(Path(shared) / worker)
        columns = os.environ.get(COLUMNS_ENV, "")
        if columns:
            os.environ["COLUMNS"] = columns
        else:
            os.environ.pop("COLUMNS", None)
        config._staronnx_private = False  # the controller checks and removes it
        return
    # pytest's own folders (tmp_path) stay where they were, so they are kept for debugging
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    base = Path(tempfile.mkdtemp(prefix="pytest-private-"))
    before = snapshot(REAL_HOME)
    config._staronnx_private = (base, before, live_owners(before))
    _use_private(base)
    os.environ[PRIVATE_ENV] = str(base)
    os.environ[REAL_HOME_ENV] = str(REAL_HOME)
    os.environ[COLUMNS_ENV] = os.environ.get("COLUMNS", "")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if it wrote into the real home or left staronnx temporaries; clean up."""
    private = getattr(session.config, "_staronnx_private", None)
    if not private:  # not configured, or an xdist worker (its controller checks)
        return
    base, before, concurrent = private
    problems = [f"the suite changed the real STARONNX_HOME {REAL_HOME}: {c}"
                for c in home_changes(before, snapshot(REAL_HOME), concurrent)]
    # the session's own TMPDIR and each xdist worker's (<base>/<worker>/tmp)
    problems += [f"the suite left {tmp / name} (a temporary nobody removed)"
                 for tmp in [base / "tmp", *sorted(base.glob("*/tmp"))] for name in leaked_temporaries(tmp)]
    shutil.rmtree(base, ignore_errors=True)
    if problems:
        writer = session.config.get_terminal_writer()
        for line in problems:
            writer.line(f"staronnx test isolation: {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


#: batch sizes the shared plan is calibrated at (arch cpu1: one-PU groups)
CALIBRATED_SIZES = [1, 2, 4]


@pytest.fixture(scope="session")
def calibrated_inception(tmp_path_factory) -> tuple[Plan, Path]:
    """A 70/30 plan of a 2-block Inception model and a store with its models of one-PU groups
    (arch cpu1, as :func:`two_groups` makes) at batch 1, 2 and 4 (what sweeps, the simulator,
    the bound and the optimizer need)."""
    root = tmp_path_factory.mktemp("calibrated")
    onnx.save(inception(blocks=2, channels=8, size=16), str(root / "inception.onnx"))
    plan = partition(root / "inception.onnx", [0.7, 0.3], PartitionSpec(profile_runs=2), output_dir=root / "plan")
    home = root / "home"
    # one explicit one-PU group: one worker measures arch cpu1 on any host (cores=1 would
    # start one per core)
    workers = start_workers(plan, MachineSpec(groups=str(min(os.sched_getaffinity(0)))))
    try:
        # this plan's parts take tens of microseconds: on a loaded machine StarPU's outlier
        # rule can keep an entry from reaching 10 accepted samples within one calibration's
        # cap, so calibrate again (the store keeps what was accepted) until every entry has
        report = calibrate(plan, CALIBRATED_SIZES, workers=workers, store=PerfModelStore(home))
        for _ in range(4):
            if not report.uncalibrated:
                break
            report = calibrate(plan, CALIBRATED_SIZES, workers=workers, store=PerfModelStore(home), max_runs=200)
        assert not report.uncalibrated, f"could not calibrate {report.uncalibrated} (machine too noisy?)"
    finally:
        for w in workers:
            w.close()
    return plan, home


@pytest.fixture
def fragile_plan(tmp_path) -> Plan:
    """:func:`staronnx.zoo.fragile` cut in two: a request whose ``x`` is not ``(n, 8)`` passes
    every signature check and fails in part 1, inside ONNX Runtime."""
    model = tmp_path / "fragile.onnx"
    onnx.save(fragile(), str(model))
    return partition(model, spec=PartitionSpec(parts=2, method="linear", input_shapes=["x=1x8"], costs="estimate"),
                     output_dir=tmp_path / "fragile-plan")


@pytest.fixture(scope="session")
def two_groups() -> str:
    """Two one-PU CPU groups as an explicit policy ('3;5'), whatever the host's core count,
    so tests that count workers or lanes hold on 2 cores or 128."""
    import os

    pus = sorted(os.sched_getaffinity(0))
    if len(pus) < 2:
        pytest.skip("needs 2 allowed PUs for two CPU groups")
    return f"{pus[0]};{pus[1]}"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path]:
    """(model, plan folder named ``plan``) of a tiny Inception cut 70/30 (costs estimated:
    quick), for the CLI tests that need a model and a plan and nothing particular."""
    root = tmp_path_factory.mktemp("small")
    model = root / "inception.onnx"
    onnx.save(inception(blocks=2, channels=8, size=16), str(model))
    partition(model, [0.7, 0.3], PartitionSpec(costs="estimate"), output_dir=root / "plan")
    return model, root / "plan"


@pytest.fixture(scope="session")
def real_plan(tmp_path_factory):
    """``real_plan(name, shares=None)``: a plan of ``models/real/<name>.onnx`` cut in
    two equal parts (or at ``shares``, e.g. ``"0.85,0.15"``) at its representative shapes,
    made once per session and shared (load it again with ``Plan.load(plan.root)`` to override
    its batching without touching the others')."""
    import realmodels

    made: dict[tuple[str, str | None], Plan] = {}

    def make(name: str, shares: str | None = None) -> Plan:
        key = (name, shares)
        if key not in made:
            out = tmp_path_factory.mktemp(f"real-{name}")
            made[key] = partition(str(realmodels.path(name)), shares,
                                  PartitionSpec(input_shapes=realmodels.input_shapes(name), profile_runs=1,
                                                profile_batch=2), output_dir=out / "plan", force=True)
        return made[key]

    return make


# -- running under pytest-xdist (`make test`: -n N --dist loadgroup --no-loadscope-reorder) ---------
#: test modules that share one xdist work unit across files: the Ray tests share one local Ray
#: cluster (:class:`RayCluster`), and two clusters at once on this host would contend for its
#: CPUs and Serve's HTTP proxy
SHARED_GROUPS = {"test_ray.py": "ray", "test_real_models_ray.py": "ray", "test_infer_ray.py": "ray"}
#: modules whose tests take longest, started first so that no worker ends on one of them alone
#: (ordering only: a module missing here is just scheduled later)
LONG_FIRST = ("test_ray.py", "test_real_models_ray.py", "test_infer_ray.py", "test_docs.py", "test_docs_serve.py",
              "test_readme.py", "test_infer.py", "test_cli_rough_edges.py",
              "test_multi_model_sweep.py", "test_cli_usability.py", "test_new_user.py", "test_calibrate.py",
              "test_sweep.py", "test_cuda_cli.py", "test_serve_hostile.py", "test_real_models_serve.py",
              "test_cli_signals.py", "test_serve.py")
#: modules of slow, independent tests whose fixtures are cheap (or session-wide): their tests
#: are spread over the workers one by one rather than kept on their module's worker
SPREAD = {"test_cli_rough_edges.py", "test_multi_model_sweep.py", "test_cli_usability.py", "test_new_user.py",
          "test_calibrate.py", "test_sweep.py", "test_cuda_cli.py", "test_cli_signals.py", "test_infer.py"}

#: tests (``module::function``, every case of a parametrized one) spread one by one as the modules
#: of :data:`SPREAD` are, while the other tests of their module stay together: each runs one
#: documentation page in a folder of its own (free ports, no module fixture), and kept together
#: the pages made their module the last one to finish on its worker
SPREAD_TESTS = {"test_docs.py::test_page_commands_run_as_written",
                "test_docs_serve.py::test_server_page_commands_run_as_written"}


def xdist_scope(nodeid: str) -> str:
    """The xdist work unit a test belongs to: its module (so a module's fixtures are made once and
    its tests never run beside each other), the shared group of :data:`SHARED_GROUPS`, or the
    test alone for the modules of :data:`SPREAD` and the tests of :data:`SPREAD_TESTS`."""
    path = nodeid.split("::", 1)[0]
    name = path.rsplit("/", 1)[-1]
    function = nodeid.split("[", 1)[0].rsplit("/", 1)[-1]
    return nodeid if name in SPREAD or function in SPREAD_TESTS else SHARED_GROUPS.get(name, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` (``make test``) as :func:`xdist_scope` groups the tests. xdist's own
    loadgroup reads the group from an ``@group`` suffix its workers append to ``item._nodeid``,
    which pytest 9 no longer reports (a node id is built from ``item._id``): every test became a
    unit of its own, the Ray tests ran on several workers at once, each starting a Ray cluster
    and its Serve apps, and module fixtures were made once per worker. The scheduler sees node
    ids only, so the grouping is computed from them here."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return ModuleGroups(config, log)


# -- one local Ray cluster for the Ray group ------------------------------------------------------
#: Serve kills an HTTP proxy actor not ready within 5 s (and one whose health check takes over
#: 10 s): on a busy 2-core host the proxy's process takes longer to start, and every `serve --ray`
#: failed. Set while the cluster runs; the cluster's processes and the CLI's inherit them.
RAY_PATIENCE = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "120", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}


class RayCluster:
    """The local Ray cluster (2 CPUs, 2 declared GPUs, no dashboard) of the modules of the "ray"
    group (:data:`SHARED_GROUPS`): started by the first of their tests that asks for it, and shut
    down (Serve, then Ray) after the group's last test, by :func:`pytest_runtest_teardown`.
    Starting and stopping a cluster spawns a dozen processes; one per module cost the loaded
    worker that runs the group two more of each, and the group's modules run one after the other
    on that worker anyway (xdist keeps the group on one worker; :data:`LONG_FIRST` orders them)."""

    def __init__(self) -> None:
        self.address: str | None = None
        self.saved: dict[str, str | None] = {}

    def start(self) -> str:
        """The cluster's GCS address (what RAY_ADDRESS takes), started if it is not running."""
        if self.address is None:
            import ray

            self.saved = {k: os.environ.get(k) for k in RAY_PATIENCE}
            os.environ.update(RAY_PATIENCE)
            try:
                # two GPUs declared (none needed: a replica given them drives HostRuntime stand-ins)
                ctx = ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING",
                               log_to_driver=False)
            except BaseException:
                self._restore()
                raise
            self.address = ctx.address_info["gcs_address"]
        return self.address

    def stop(self) -> None:
        """Serve, then Ray, shut down; the environment as it was."""
        if self.address is None:
            return
        import ray
        from ray import serve

        self.address = None
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self._restore()

    def _restore(self) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


RAY_CLUSTER = RayCluster()


@pytest.fixture(scope="module")
def cluster() -> str:
    """The Ray group's local cluster (:class:`RayCluster`); its GCS address. Skips with the
    reason where Ray or Serve is not installed, or cannot start here."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'staronnx[ray]')")
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'staronnx[ray]')")
    try:
        return RAY_CLUSTER.start()
    except Exception as exc:  # noqa: BLE001 - no Ray here: say why and skip
        pytest.skip(f"Ray cannot start a local cluster here: {type(exc).__name__}: {exc}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After a test's own teardown (its fixtures, the servers they started, gone): the Ray
    cluster shut down when the next test is not of the Ray group, or there is none."""
    yield
    if RAY_CLUSTER.address is not None and (nextitem is None or xdist_scope(nextitem.nodeid) != "ray"):
        RAY_CLUSTER.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The modules of :data:`LONG_FIRST` are queued first (under xdist too: ``--no-loadscope-reorder``
    keeps the work units in this order)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept otherwise
