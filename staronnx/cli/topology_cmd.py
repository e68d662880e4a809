"""``staronnx topology``: show the machine as hwloc sees it and the CPU groups a policy gives.

Useful before a run (which cores will each CPU worker own? are some PUs disallowed?) and to
try a policy on another machine's topology: ``--xml`` takes what ``lstopo server.xml`` wrote
there, ``--synthetic`` a made-up one such as ``"pack:2 numa:2 core:8 pu:2"``. With
``--cuda-streams`` (and ``--cuda-devices``) it shows every worker ``run``/``serve`` would start
with those settings, as StarPU's ``starpu_machine_display`` does: each CUDA worker's GPU and
the core its driver thread is pinned to, each CPU group, and the GPUs CUDA sees here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from staronnx.cli.display import output_console, table_of
from staronnx.errors import StaronnxError
from staronnx.workers.groups import DEFAULT_POLICY, CpuGroup, CpuGroups, make_groups
from staronnx.workers.layout import Layout, MachineSpec, layout
from staronnx.workers.topology import Topology, format_pus


def groups_table(groups: CpuGroups) -> Table:
    """A rich table of the groups (and reserved cores) of a policy."""
    table = table_of(f"CPU groups for policy {groups.policy!r}",
                     ("group", "name", "cores", "PUs", "first PU", "NUMA", "package", "ORT thread PUs"), fold=True)
    for g in groups:
        table.add_row(
            str(g.id),
            g.name,
            str(g.n_cores),
            format_pus(g.pus),
            str(g.first_pu),
            ",".join(map(str, g.numa_nodes)) or "-",
            "-" if g.package is None else str(g.package),
            g.ort_thread_affinities() and _zero_based(g) or "-",
        )
    if groups.reserved:
        table.add_row(
            "-", "reserved (GPU threads)", str(len(groups.reserved)),
            format_pus(groups.reserved_pus), "-", "-", "-", "-",
        )
    return table


def workers_table(laid: Layout) -> Table:
    """Every worker a runtime of ``laid``'s spec starts, in its order (CUDA streams first, GPU
    by GPU), with its arch, memory node and PUs: a CUDA worker's are its driver thread's."""
    spec = laid.spec
    table = table_of(f"workers for --groups {spec.groups!r}, --cuda-streams {spec.cuda_streams}"
                     + (f", --cuda-devices {','.join(map(str, spec.cuda_devices))}" if spec.cuda_streams else ""),
                     ("worker", "kind", "arch (perf models)", "memory node", "PUs"), fold=True)
    for w in laid.workers:
        if w.group is not None:
            where = format_pus(w.group.pus)
        else:
            where = f"driver thread on PU {w.pu}" if w.pu is not None else "driver thread not pinned"
        table.add_row(w.name, w.kind, w.arch, w.memory_node, where)
    return table


def _zero_based(group: CpuGroup) -> str:
    """The pool threads' PUs as OS indexes (ORT's own string is 1-based, confusing to read)."""
    return "; ".join(format_pus(pus) for pus in group.core_pus[1:])


def load_topology(synthetic: str | None, xml: Path | None) -> Topology:
    """The topology the options ask for: synthetic, XML, or this system."""
    if synthetic is not None and xml is not None:
        raise StaronnxError("give either --synthetic or --xml, not both")
    if synthetic is not None:
        return Topology.from_synthetic(synthetic)
    if xml is not None:
        return Topology.from_xml(xml)
    return Topology.from_system()


def register(app: typer.Typer) -> None:
    """Add the ``topology`` command to ``app``."""

    @app.command("topology")
    def topology(
        synthetic: Annotated[Optional[str], typer.Option(
            "--synthetic", help="hwloc synthetic description, e.g. 'pack:2 numa:2 core:8 pu:2'.")] = None,
        xml: Annotated[Optional[Path], typer.Option(
            "--xml", help="Topology XML written by 'lstopo FILE.xml' or --export-xml.")] = None,
        groups: Annotated[str, typer.Option(
            "--groups", help="CPU group policy: numa, package, cores=N or '0-3;4-7', optionally ',reserve=N'.",
        )] = DEFAULT_POLICY,
        export_xml: Annotated[Optional[Path], typer.Option(
            "--export-xml", help="Also save the topology as hwloc XML to this file.")] = None,
        cuda_streams: Annotated[int, typer.Option(
            help="Also show the workers run/serve would start with this many CUDA streams per GPU.")] = 0,
        cuda_devices: Annotated[Optional[str], typer.Option(
            help="With --cuda-streams: the GPUs (0,1 or 0-3 or all); any ordinal with --synthetic or --xml "
                 "(another machine's). Default: 0.")] = None,
        thread_per_stream: Annotated[bool, typer.Option(
            "--cuda-thread-per-stream", help="With --cuda-streams: a driver thread, and a core held back, per "
                                             "stream rather than per GPU (as run, serve and sweep take it).")] = False,
    ) -> None:
        """Show the machine's topology (packages, NUMA nodes, cores, PUs) and its CPU groups; with
        --cuda-streams, every worker a run would start, CUDA driver threads' cores included."""
        from staronnx.cli.gpus import check_cuda_worker_flags, parse_cuda_devices

        check_cuda_worker_flags(cuda_streams, thread_per_stream=thread_per_stream)
        topo = load_topology(synthetic, xml)
        elsewhere = synthetic is not None or xml is not None
        devices = parse_cuda_devices(cuda_devices, cuda_streams, simulated=elsewhere)
        # with CUDA streams, the groups as the runtime makes them: a core held back per GPU driver thread
        laid = (layout(MachineSpec(groups, cuda_streams, devices, thread_per_stream=thread_per_stream), topo)
                if cuda_streams else None)
        console = output_console()  # 200 wide on a pipe, as every command's results: no name cut
        console.print(topo.rich_tree())
        console.print(groups_table(laid.groups if laid is not None else make_groups(topo, groups)))
        if laid is not None:
            console.print(workers_table(laid))
        if not elsewhere:
            from staronnx.workers.cuda import cuda_unavailable_reason
            from staronnx.workers.cuda_env import describe_gpus

            gpus = describe_gpus()
            if not gpus:  # said, and --export-xml still written below
                console.print(f"no GPU for CUDA workers here: {cuda_unavailable_reason()}", highlight=False,
                              soft_wrap=True, markup=False)  # the reason names staronnx[gpu], not markup
            else:
                table = table_of(f"GPUs CUDA workers can use here: {len(gpus)}",
                                 ("GPU", "model", "memory", "compute capability", "SMs", "PCI bus"), fold=True)
                for g in gpus:
                    memory = "-" if g["memory_bytes"] is None else f"{g['memory_bytes'] / 2**30:.1f} GiB"
                    table.add_row(f"cuda{g['device']}", g["name"], memory,
                                  *("-" if g[k] is None else str(g[k]) for k in ("capability", "sms", "pci_bus")))
                console.print(table)
        if export_xml is not None:
            console.print(f"topology written to {topo.export_xml(export_xml)}")
