"""Finding libstarpu and compiling staronnx's cffi binding to it, once per user and version.

cffi in API mode, not ctypes: StarPU's structs (``starpu_conf``, ``starpu_task``, ...) have
configure-time array sizes, bitfields and fields that come and go between versions; a ctypes
mirror would silently read the wrong bytes the day the library is rebuilt, while compiling
against the installed headers gets the real layouts or a compile error. The C part only fills
the conf, builds codelets, registers vectors and submits tasks; the rest stays in Python,
reached through cffi ``extern "Python"`` callbacks.

StarPU is looked for in ``$STARPU_PREFIX`` (then only there), then ``pkg-config starpu-1.4`` /
``starpu-1.3``, then ``/usr/include/starpu/1.x``. The module is built with ``$CC`` (or ``cc``)
under a file lock into ``$STARONNX_HOME/starpu-cffi/<key>/``, the key hashing everything that
changes the binary, and moved into place whole, so concurrent first uses never see half a module.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import io
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from staronnx.errors import StaronnxError
from staronnx.perfmodels.store import default_root

INSTALL_HINT = (
    "install it with `apt-get install libstarpu-dev` (Debian/Ubuntu; `starpu-tools` adds "
    "starpu_perfmodel_display), or point STARPU_PREFIX at a StarPU 1.3/1.4 installation"
)


class StarpuUnavailable(StaronnxError, RuntimeError):
    """StarPU (or what is needed to bind it: a C compiler, Python's headers) is missing."""


@dataclass(frozen=True)
class StarpuInstall:
    """Where a StarPU installation is and how to compile and link against it."""

    version: str  # "1.3" or "1.4" (from the pkg-config name or the include folder)
    cflags: tuple[str, ...]
    libs: tuple[str, ...]
    source: str  # how it was found, for messages

    @property
    def lib_dirs(self) -> list[str]:
        return [f[2:] for f in self.libs if f.startswith("-L")]


_VERSIONS = ("1.4", "1.3")


def _pkg_config(name: str, env: dict[str, str] | None = None) -> StarpuInstall | None:
    exe = shutil.which("pkg-config")
    if exe is None:
        return None
    try:
        cflags = subprocess.run([exe, "--cflags", name], check=False, capture_output=True, text=True, env=env, timeout=30)
        libs = subprocess.run([exe, "--libs", name], check=False, capture_output=True, text=True, env=env, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if cflags.returncode or libs.returncode:
        return None
    version = name.rsplit("-", 1)[1]
    return StarpuInstall(version, tuple(shlex.split(cflags.stdout)), tuple(shlex.split(libs.stdout)),
                         f"pkg-config {name}")


def _from_prefix(prefix: Path) -> StarpuInstall | None:
    pcdirs = glob.glob(str(prefix / "lib*" / "pkgconfig")) + glob.glob(str(prefix / "lib" / "*" / "pkgconfig"))
    if pcdirs:
        env = dict(os.environ, PKG_CONFIG_PATH=os.pathsep.join(pcdirs))
        for v in _VERSIONS:
            if any(Path(d, f"starpu-{v}.pc").exists() for d in pcdirs):
                found = _pkg_config(f"starpu-{v}", env)
                if found is not None:
                    return replace(found, source=f"STARPU_PREFIX={prefix} ({found.source})")
    return _from_headers(prefix / "include", [prefix / "lib", prefix / "lib64", *prefix.glob("lib/*-linux-gnu")],
                         f"STARPU_PREFIX={prefix}")


def _from_headers(include: Path, libdirs: list[Path], source: str) -> StarpuInstall | None:
    for v in _VERSIONS:
        inc = include / "starpu" / v
        if not (inc / "starpu.h").exists():
            continue
        for d in libdirs:
            if list(d.glob(f"libstarpu-{v}.so*")):
                return StarpuInstall(v, (f"-I{inc}",), (f"-L{d}", f"-lstarpu-{v}"), source)
        if not libdirs:
            return StarpuInstall(v, (f"-I{inc}",), (f"-lstarpu-{v}",), source)
    return None


def find_starpu() -> StarpuInstall:
    """Locate StarPU's headers and library, or raise :class:`StarpuUnavailable`."""
    prefix = os.environ.get("STARPU_PREFIX")
    if prefix:
        found = _from_prefix(Path(prefix).expanduser())
        if found is None:
            raise StarpuUnavailable(
                f"STARPU_PREFIX={prefix} holds no StarPU 1.3/1.4 (no starpu-1.x.pc, no "
                f"include/starpu/1.x/starpu.h with lib*/libstarpu-1.x.so); {INSTALL_HINT}")
        return found
    for v in _VERSIONS:
        found = _pkg_config(f"starpu-{v}")
        if found is not None:
            return found
    libdirs = [Path(p) for p in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                                 "/usr/lib", "/usr/local/lib") if Path(p).is_dir()]
    for include in (Path("/usr/include"), Path("/usr/local/include")):
        found = _from_headers(include, libdirs, f"{include}/starpu")
        if found is not None:
            return found
    raise StarpuUnavailable(f"StarPU was not found (no pkg-config starpu-1.3/starpu-1.4, no "
                            f"/usr/include/starpu/1.x); {INSTALL_HINT}")


# --------------------------------------------------------------------------- the binding
CDEF = r"""
typedef struct _starpu_data_state *starpu_data_handle_t;
struct starpu_codelet;

static const int STARPU_R;
static const int STARPU_W;
static const int STARPU_RW;
static const int STARPU_NMAXBUFS;
static const int STARPU_MAXCPUS;
static const int STARPU_NMAXWORKERS;

int sx_init(const char *sched, int ncpus, const unsigned *bindids);
int sx_has_cuda(void);
void sx_shutdown(void);
int starpu_task_wait_for_all(void);
void starpu_get_version(int *major, int *minor, int *release);

unsigned starpu_worker_get_count(void);
int starpu_worker_get_bindid(int workerid);
int sx_worker_is_cpu(int workerid);
void starpu_worker_get_name(int id, char *dst, size_t maxlen);

int sx_policy_count(void);
const char *sx_policy_name(int i);
const char *sx_policy_description(int i);
const char *sx_current_policy(void);
int starpu_sched_get_min_priority(void);
int starpu_sched_get_max_priority(void);

struct starpu_codelet *sx_codelet_new(const char *name, const char *symbol);
void sx_codelet_free(struct starpu_codelet *cl);
void starpu_perfmodel_get_model_path(const char *symbol, char *path, size_t maxlen);

starpu_data_handle_t sx_register(void *ptr, size_t nbytes);
void starpu_data_unregister_submit(starpu_data_handle_t handle);
int sx_submit(struct starpu_codelet *cl, int n, starpu_data_handle_t *handles, const int *modes,
              long long key, unsigned batch, uint32_t shape_hash, int priority, int callback);
int sx_submit_request(int ntensors, void **ptrs, const size_t *nbytes, int nparts,
                      struct starpu_codelet **cls, const int *nbufs, const int *bufs, const int *modes,
                      const int *priorities, const int *callbacks, long long key0, unsigned batch,
                      uint32_t shape_hash, int *nsubmitted);
void sx_on_each_cpu_worker(void);

extern "Python" void sx_py_run(long long key, int workerid, uintptr_t *ptrs, size_t *sizes, int n,
                               double predicted);
extern "Python" void sx_py_done(long long key);
extern "Python" void sx_py_worker_init(int workerid);
"""

CSRC = r"""
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <starpu.h>

static void sx_py_run(long long key, int workerid, uintptr_t *ptrs, size_t *sizes, int n, double predicted);
static void sx_py_done(long long key);
static void sx_py_worker_init(int workerid);

struct sx_arg { long long key; unsigned batch; uint32_t shape_hash; };

int sx_init(const char *sched, int ncpus, const unsigned *bindids)
{
    struct starpu_conf conf;
    int i, ret = starpu_conf_init(&conf);
    if (ret) return ret;
    conf.precedence_over_environment_variables = 1;  /* the Runtime's arguments win over STARPU_* */
    conf.sched_policy_name = sched;
    conf.ncpus = ncpus;
    conf.ncuda = 0;    /* CPU codelets only (see the engine's docstring) */
    conf.nopencl = 0;
#if STARPU_MAJOR_VERSION == 1 && STARPU_MINOR_VERSION <= 3
    conf.nmic = 0;
#endif
    conf.use_explicit_workers_bindid = 1;
    for (i = 0; i < ncpus && i < STARPU_NMAXWORKERS; i++)
        conf.workers_bindid[i] = bindids[i];
    return starpu_init(&conf);
}

int sx_has_cuda(void)
{
#ifdef STARPU_USE_CUDA
    return 1;
#else
    return 0;
#endif
}

void sx_shutdown(void)
{
    starpu_task_wait_for_all();
    starpu_shutdown();
}

int sx_worker_is_cpu(int workerid)
{
    return starpu_worker_get_type(workerid) == STARPU_CPU_WORKER;
}

static int sx_npolicies(void)
{
    struct starpu_sched_policy **p = starpu_sched_get_predefined_policies();
    int n = 0;
    while (p[n]) n++;
    return n;
}
int sx_policy_count(void) { return sx_npolicies(); }
const char *sx_policy_name(int i) { return starpu_sched_get_predefined_policies()[i]->policy_name; }
const char *sx_policy_description(int i)
{
    const char *d = starpu_sched_get_predefined_policies()[i]->policy_description;
    return d ? d : "";
}
const char *sx_current_policy(void)
{
    struct starpu_sched_policy *p = starpu_sched_ctx_get_sched_policy(0 /* the initial context */);
    return p && p->policy_name ? p->policy_name : "";
}

/* history-based model: footprint = crc32c(batch) (chained with the other dims' hash when the
   plan has symbolic dims besides the batch), size = the batch size */
static uint32_t sx_footprint(struct starpu_task *task)
{
    struct sx_arg *a = task->cl_arg;
    return starpu_hash_crc32c_be(a->batch, a->shape_hash);
}
static size_t sx_size_base(struct starpu_task *task, unsigned nimpl)
{
    struct sx_arg *a = task->cl_arg;
    return a->batch;
}

static void sx_cpu_func(void *buffers[], void *cl_arg)
{
    struct sx_arg *a = cl_arg;
    struct starpu_task *task = starpu_task_get_current();
    int i, n = (int) STARPU_TASK_GET_NBUFFERS(task);
    uintptr_t ptrs[n > 0 ? n : 1];
    size_t sizes[n > 0 ? n : 1];
    for (i = 0; i < n; i++) {
        ptrs[i] = STARPU_VECTOR_GET_PTR(buffers[i]);
        sizes[i] = (size_t) STARPU_VECTOR_GET_NX(buffers[i]) * STARPU_VECTOR_GET_ELEMSIZE(buffers[i]);
    }
    sx_py_run(a->key, starpu_worker_get_id(), ptrs, sizes, n, task->predicted);
}

static void sx_callback(void *arg)
{
    struct sx_arg *a = arg;
    sx_py_done(a->key);
}

struct starpu_codelet *sx_codelet_new(const char *name, const char *symbol)
{
    struct starpu_codelet *cl = calloc(1, sizeof *cl);
    struct starpu_perfmodel *pm = calloc(1, sizeof *pm);
    if (!cl || !pm) { free(cl); free(pm); return NULL; }
    starpu_codelet_init(cl);
    pm->type = STARPU_HISTORY_BASED;
    pm->symbol = strdup(symbol);
    pm->footprint = sx_footprint;
    pm->size_base = sx_size_base;
    cl->where = STARPU_CPU;
    cl->cpu_funcs[0] = sx_cpu_func;
    cl->cpu_funcs_name[0] = "staronnx_part_cpu";
    cl->nbuffers = STARPU_VARIABLE_NBUFFERS;
    cl->model = pm;
    cl->name = strdup(name);
    return cl;
}

void sx_codelet_free(struct starpu_codelet *cl)
{
    if (!cl) return;
    if (cl->model) { free((char *) cl->model->symbol); free(cl->model); }
    free((char *) cl->name);
    free(cl);
}

starpu_data_handle_t sx_register(void *ptr, size_t nbytes)
{
    starpu_data_handle_t h;
    if (ptr)
        starpu_vector_data_register(&h, STARPU_MAIN_RAM, (uintptr_t) ptr, (uint32_t) nbytes, 1);
    else  /* lazily allocated by StarPU on the node of the first (writing) task */
        starpu_vector_data_register(&h, -1, 0, (uint32_t) nbytes, 1);
    return h;
}

int sx_submit(struct starpu_codelet *cl, int n, starpu_data_handle_t *handles, const int *modes,
              long long key, unsigned batch, uint32_t shape_hash, int priority, int callback)
{
    int i, ret;
    struct starpu_task *task = starpu_task_create();
    struct sx_arg *a = malloc(sizeof *a);
    if (!task || !a) { free(a); return -ENOMEM; }
    a->key = key; a->batch = batch; a->shape_hash = shape_hash;
    task->cl = cl;
    task->nbuffers = n;
    if (n > STARPU_NMAXBUFS) {  /* freed by StarPU with the task */
        task->dyn_handles = malloc(n * sizeof(starpu_data_handle_t));
        task->dyn_modes = malloc(n * sizeof(enum starpu_data_access_mode));
    }
    for (i = 0; i < n; i++) {
        STARPU_TASK_SET_HANDLE(task, handles[i], i);
        STARPU_TASK_SET_MODE(task, (enum starpu_data_access_mode) modes[i], i);
    }
    task->cl_arg = a;
    task->cl_arg_size = sizeof *a;
    task->cl_arg_free = 1;
    task->priority = priority;
    if (callback) {
        task->callback_func = sx_callback;
        task->callback_arg = a;  /* freed with cl_arg, after the callback */
    }
    ret = starpu_task_submit(task);
    if (ret) {
        task->destroy = 0;
        starpu_task_destroy(task);
    }
    return ret;
}

/* One request in one call (one GIL release instead of one per handle and task): register its
   tensors (ptr NULL: StarPU allocates lazily), submit one task per part in the plan's order
   (part p names tensors bufs[off_p .. off_p + nbufs[p]) with modes[...], key = key0 + p), then
   unregister_submit every handle: StarPU frees them once the last task using them is done. */
int sx_submit_request(int ntensors, void **ptrs, const size_t *nbytes, int nparts,
                      struct starpu_codelet **cls, const int *nbufs, const int *bufs, const int *modes,
                      const int *priorities, const int *callbacks, long long key0, unsigned batch,
                      uint32_t shape_hash, int *nsubmitted)
{
    int i, p, off = 0, ret = 0;
    starpu_data_handle_t *hs = malloc((ntensors > 0 ? ntensors : 1) * sizeof *hs);
    starpu_data_handle_t *th = malloc((ntensors > 0 ? ntensors : 1) * sizeof *th);
    *nsubmitted = 0;
    if (!hs || !th) { free(hs); free(th); return -ENOMEM; }
    for (i = 0; i < ntensors; i++)
        hs[i] = sx_register(ptrs[i], nbytes[i]);
    for (p = 0; p < nparts; p++) {
        for (i = 0; i < nbufs[p]; i++)
            th[i] = hs[bufs[off + i]];
        ret = sx_submit(cls[p], nbufs[p], th, modes + off, key0 + p, batch, shape_hash,
                        priorities[p], callbacks[p]);
        off += nbufs[p];
        if (ret) break;
        (*nsubmitted)++;
    }
    for (i = 0; i < ntensors; i++)
        starpu_data_unregister_submit(hs[i]);
    free(hs);
    free(th);
    return ret;
}

static void sx_worker_init(void *arg)
{
    (void) arg;
    sx_py_worker_init(starpu_worker_get_id());
}

void sx_on_each_cpu_worker(void)
{
    starpu_execute_on_each_worker(sx_worker_init, NULL, STARPU_CPU);
}
"""

_lock = threading.Lock()
#: ``(ffi, lib, install)`` once loaded: cffi's objects are untyped, the install is ours
_loaded: tuple[Any, Any, StarpuInstall] | None = None


def _compiler() -> list[str]:
    cc = shlex.split(os.environ.get("CC", "") or "cc")
    if shutil.which(cc[0]) is None:
        raise StarpuUnavailable(
            f"the StarPU engine compiles a small binding on first use and needs a C compiler, "
            f"but {cc[0]!r} was not found; install one (`apt-get install gcc`) or set CC")
    return cc


def _python_include() -> str:
    inc = sysconfig.get_paths()["include"]
    if not Path(inc, "Python.h").exists():
        raise StarpuUnavailable(
            f"the StarPU engine compiles a small binding on first use and needs Python's headers "
            f"(Python.h not in {inc}); install them (`apt-get install python3-dev`)")
    return inc


def load_binding() -> tuple[Any, Any, StarpuInstall]:
    """``(ffi, lib, install)``: the compiled binding, built into the cache on first use."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        install = find_starpu()
        import cffi

        cc = _compiler()
        pyinc = _python_include()
        key_src = "\n".join([CDEF, CSRC, install.version, " ".join(install.cflags), " ".join(install.libs),
                             sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", cffi.__version__,
                             " ".join(cc)])
        key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
        modname = f"_staronnx_starpu_{key}"
        folder = default_root() / "starpu-cffi" / key
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        so_path = folder / f"{modname}{suffix}"
        if not so_path.exists():
            _compile(install, cc, pyinc, modname, folder, so_path.name)
        spec = importlib.util.spec_from_file_location(modname, so_path)
        if spec is None or spec.loader is None:
            raise StarpuUnavailable(f"cannot load the compiled StarPU binding {so_path}")
        # RTLD_DEEPBIND: libstarpu must call *its* libhwloc.  pyhwloc (staronnx's topology)
        # loads a bundled hwloc 3 with RTLD_GLOBAL, whose same-named symbols would otherwise
        # interpose on the hwloc 2 that Debian's StarPU 1.3 was built against (lws crashed in
        # starpu_init on exactly that).  The binding and its dependencies resolve in their own
        # scope first; Python's API still comes from the global scope.
        old_flags = sys.getdlopenflags()
        # getattr: RTLD_DEEPBIND is glibc's (musl's and macOS' os module have none)
        sys.setdlopenflags(os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0))
        try:
            module = importlib.util.module_from_spec(spec)  # dlopen() happens here
            spec.loader.exec_module(module)
        except ImportError as exc:
            raise StarpuUnavailable(f"the compiled StarPU binding {so_path} does not load ({exc}); "
                                    f"remove {folder} to rebuild it; {INSTALL_HINT}") from None
        finally:
            sys.setdlopenflags(old_flags)
        loaded = _loaded = (module.ffi, module.lib, install)
        return loaded


def _compile(install: StarpuInstall, cc: list[str], pyinc: str, modname: str, folder: Path, so_name: str) -> None:
    import cffi
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / so_name).exists():  # built by another process meanwhile
            return
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        ffi.set_source(modname, CSRC)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            c_file = tmp / f"{modname}.c"
            with contextlib.redirect_stdout(io.StringIO()):  # cffi says "generating ..."
                ffi.emit_c_code(str(c_file))
            rpath = [f"-Wl,-rpath,{d}" for d in install.lib_dirs]
            cmd = [*cc, "-shared", "-fPIC", "-O2", "-w", f"-I{pyinc}", *install.cflags, str(c_file),
                   "-o", str(tmp / so_name), *install.libs, *rpath]
            proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise StarpuUnavailable(
                    f"compiling the StarPU binding against {install.source} failed:\n"
                    f"{' '.join(cmd)}\n{proc.stderr.strip()[-3000:]}")
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
