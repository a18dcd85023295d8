"""A session's plan (ONNX Runtime's session initialisation): the model loaded and prepared, each EP asked in turn
which nodes it takes (GetCapability, the nodes taken already marked), the groups fused into partitions without a
cycle (client/planner.py), each compiled on its EP, and what no EP takes given to the in-process CPU fallback
(client/fallback.py); the model written again with EPContext nodes where the session config asks."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ephost.eps.base import capability
from ephost.graph import GraphIndex, prepare_model
from ephost.client.context_model import ENABLE, CompiledPartition, ContextSettings, embed_files, write_context_model
from ephost.client.devices import EpDevice
from ephost.client.failure_policy import FailurePolicy, FellBack
from ephost.client.fallback import CpuFallback
from ephost.client.loading import Loaded
from ephost.client.optimized_model import write_optimized_model
from ephost.client.providers import provider_names, release, session_entries
from ephost.client.planner import Claim, Partition, Placement, plan_partitions

log = logging.getLogger(__name__)

# The EPs a session uses, in order: each one's devices and provider options.
Entry = tuple[list[EpDevice], dict[str, str]]


@dataclass(frozen=True)
class AssignedNode:
    name: str
    op_type: str
    domain: str


@dataclass(frozen=True)
class AssignedSubgraph:
    """One partition and the EP it runs on (ONNX Runtime's OrtEpAssignedSubgraph)."""

    ep_name: str
    registration: str
    nodes: tuple[AssignedNode, ...]

    def get_nodes(self) -> list[AssignedNode]:
        return list(self.nodes)


class SessionPlan:
    """The prepared model and its partitions, compiled. `partitions` is a new list each time it is planned
    (set_up), in the order the partitions run."""

    def __init__(self, loaded: Loaded, env, options, failures: FailurePolicy, fallback: CpuFallback):
        """`loaded`: the model, its SessionOptions' changes made (client/loading.py)."""
        path, self.external = loaded.path, loaded.external
        if self.external:
            log.info("read the graph (%d nodes); %d external data file(s), %.2f GiB, mapped where used, not read",
                     len(loaded.model.graph.node), len(self.external.files), self.external.nbytes / (1 << 30))
        self._env, self._options, self._failures, self._fallback = env, options, failures, fallback
        # Compiled forms kept in files beside a context model are read into our prepared copy of it (after shape
        # inference, which need not see them): workers never read the application's files.
        self.model = embed_files(prepare_model(loaded.model), os.path.dirname(os.path.abspath(path)) if path else None)
        self.index = GraphIndex.of(self.model)
        # Kept for the session's life: a restarted worker gets the same descriptors again, nothing re-read.
        self.index.external = self.external
        self.constants = {t.name: t for t in self.model.graph.initializer}
        self._context = ContextSettings.of(options.session_config, path)
        self.partitions: list[Partition] = []
        self.entries: list[Entry] = []
        self.ep_context_files: list[str] = []  # what ep.context_enable=1 wrote: the context model, its files
        self.launched: list[str] = []  # registrations this plan made itself: unregistered as it is released
        self._ep_config = options.ep_config()  # what every EP of the session is created with (CreateEp)
        self._eps: list[tuple[Any, Any]] = []  # (registration, ep), to release

    def set_up(self, providers: Sequence[tuple[str, Mapping[str, str]]]) -> None:
        """Partition and compile on the SessionOptions' EPs, then `providers` ((name, options): what a name
        means is client/providers.py's to say), or those a selection policy picks where none is given."""
        self.entries, launched = session_entries(self._env, self._options, providers, self._fallback, self.model)
        self.launched.extend(launched)
        self.partitions = self._partition(self.entries)
        self._compile()
        if self._context.enabled:
            self._write_context_model()
        if self._options.optimized_model_filepath:  # honoured (written) or refused, never ignored
            write_optimized_model(self.model, self.external, self._options, self.partitions)

    def replan(self, providers: Sequence[str | tuple[str, Mapping[str, str]]]) -> None:
        """Partition and compile again on other EPs (ORT's set_providers; the fallback's names, ORT's
        "CPUExecutionProvider" among them, name the fallback, which is always last); workers launched for
        providers no longer used are unregistered."""
        old = list(self.launched)
        self.release_eps()
        self.set_up(providers)
        wanted = {p for p, _ in providers}
        for name in old:
            if name not in wanted:
                self.launched.remove(name)
                self._unregister(name)

    def _partition(self, entries: list[Entry]) -> list[Partition]:
        claims: list[Claim] = []
        claimed: set[str] = set()
        for devices, options in entries:
            registration = self._env.registration_of(devices[0])
            log.info("asking %s which nodes it takes", registration.name)
            options = {**self._ep_config, **options}
            if self._context.enabled or self._options.keep_compiled:  # the EP hands over each compiled form
                options = {**options, ENABLE: "1"}
            try:
                ep = self._failures.guarded(registration.name, "CreateEp", lambda: registration.factory.create_ep(
                    [d.index for d in devices], options))
                self._eps.append((registration, ep))
                groups = self._failures.guarded(registration.name, "GetCapability",
                                                lambda: capability(ep, self.model, frozenset(claimed), self.external))
            except FellBack:
                continue
            claims.append(Claim(Placement(registration.name, devices[0].ep_name, ep), groups))
            claimed.update(n for g in groups for n in g.node_names)
        fallbacks = self._fallback.claims(self.model, frozenset(claimed), self.external) \
            if set(self.index.nodes) - claimed else []
        return plan_partitions(self.index, claims, fallbacks)

    def _compile(self) -> None:
        by_ep: dict[int, list[Partition]] = {}
        for p in self.partitions:
            by_ep.setdefault(id(p.placement.ep), []).append(p)
        for parts in by_ep.values():
            name, ep = parts[0].registration, parts[0].placement.ep
            if self._fallback.owns(parts[0].placement):
                for p in parts:  # ORT may still refuse a partition it claimed: the next fallback EP takes it
                    p.placement, p.compute_info = self._fallback.compile(p.graph, p.placement)
                continue
            log.info("compiling %d partition(s) on %s", len(parts), name)
            try:
                infos = self._failures.guarded(name, "Compile", lambda: ep.compile([p.graph for p in parts]))
                allocator = self._env.registration(name).session_allocator()
            except FellBack:
                for p in parts:
                    self._failures.to_fallback(p)
                continue
            for p, info in zip(parts, infos):
                p.compute_info, p.allocator = info, allocator
            log.info("compiled %d partition(s) on %s", len(parts), name)

    def _write_context_model(self) -> None:
        """The model with each partition an EP compiled as an EPContext node carrying its compiled form; what
        the fallback runs, and partitions of EPs that make no compiled form, keep their nodes."""
        kept = []
        for p in self.partitions:
            context = None if self._fallback.owns(p.placement) else getattr(p.compute_info, "ep_context", None)
            kept.append(CompiledPartition(p.graph, p.placement.ep_name, context))
        self.ep_context_files = write_context_model(self.index, kept, self._context)

    def assignment(self) -> list[AssignedSubgraph]:
        nodes = self.index.nodes
        return [AssignedSubgraph(p.placement.ep_name, p.registration, tuple(
            AssignedNode(n, nodes[n].op_type, nodes[n].domain) for n in p.graph.nodes)) for p in self.partitions]

    def ep_names(self) -> list[str]:
        """The EPs' names, in order of preference, the fallback's last (client/providers.py)."""
        return provider_names(self.entries, self._fallback, self.partitions)

    def provider_options(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for devices, options in self.entries:
            out.setdefault(devices[0].ep_name, dict(options))
        for p in self._fallback.placements:
            out.setdefault(p.ep_name, {})
        return out

    def release_eps(self) -> None:
        """ReleaseNodeComputeInfos and ReleaseEp for every EP the plan made."""
        for registration, ep in self._eps:
            infos = [p.compute_info for p in self.partitions if p.placement.ep is ep and p.compute_info is not None]
            try:
                if infos:
                    ep.release_node_compute_infos(infos)
                registration.factory.release_ep(ep)
            except Exception as e:  # the worker may be gone; what it held went with it
                log.debug("releasing %s's partitions failed: %s", registration.name, e)
        self._eps, self.partitions = [], []

    def release(self) -> None:
        """Everything the plan holds: its EPs, its model's external data files (workers hold their own
        descriptors; ORT its own mappings) and the workers it launched."""
        self.release_eps()
        if self.external is not None:
            self.external.close()
        for name in self.launched:
            self._unregister(name)
        self.launched = []

    def _unregister(self, name: str) -> None:
        release(self._env, name)  # unregistered once no other session holds it

