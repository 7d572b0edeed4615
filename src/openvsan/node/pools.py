"""The node's pools: the config's `[[pools]]` assembled over the node's devices, and the control socket's
`pool.*` commands on them.

`ServedPools` is what the node holds (`Node.pools`): a mapping of pool name -> `ServedPool`. The node opens its
devices, then `assemble()` creates each pool on blank members or assembles it from the devices that carry its
superblock, plus those a running pool took in earlier (`pool_runtime_devices` in the store: a config device
in no use, or `file:PATH:SIZE`). `control()` answers `pool.list`, `pool.status`, `pool.scrub`, `pool.fail`,
`pool.replace` and `pool.add_spare`; a meter samples rebuild progress every second for `pool.status`. On stop,
`close()` closes the pools (they close their members) and the files opened for them that none took, and says
which devices the node must not close again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openvsan.block import BlockDevice, FileDevice
from openvsan.node.control import NotFound, RequestError
from openvsan.node.specs import PoolSpec
from openvsan.node.store import STATE_DB, StoredState, record_pool_devices
from openvsan.node.values import format_size, parse_size

if TYPE_CHECKING:
    from openvsan.pool import Pool

# the node's logger: pool lines read `node: pool pool0: ...` as they did when this lived in node.py
log = logging.getLogger("openvsan.node")

FILE_REF = "file:"


class PoolSetupError(RuntimeError):
    """A pool cannot be created or assembled, so the node cannot serve; str() is one line for the user."""


def parse_file_ref(ref: str) -> tuple[Path, int | None]:
    """`file:PATH:SIZE` or `file:PATH` (an existing file) -> (path, size). The size is the last `:` field when it
    reads as a size, so a path may hold colons."""
    body = ref.removeprefix(FILE_REF)
    path, sep, tail = body.rpartition(":")
    if sep and path:
        try:
            return Path(path), parse_size(tail)
        except ValueError:
            pass
    if not body:
        raise RequestError(f"{ref!r}: name the file, e.g. file:/var/lib/openvsan/d9.img:64MiB")
    return Path(body), None


@dataclass
class RebuildMeter:
    """How fast a pool's rebuild goes, from the members' checkpoints sampled once a second (the pool reports
    progress, not speed)."""

    samples: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=6))
    who: tuple[int, ...] = ()

    def sample(self, pool: Pool) -> None:
        from openvsan.pool.superblock import MemberState

        rebuilding = [m for m in pool.members if m.state is MemberState.REBUILDING]
        who = tuple(id(m.dev) for m in rebuilding)
        if who != self.who:
            self.samples.clear()
            self.who = who
        if rebuilding:
            self.samples.append((time.monotonic(), sum(m.checkpoint for m in rebuilding) * pool.chunk_size))

    def rate(self) -> float | None:
        """Bytes/s of member data rebuilt over the last few seconds; None before two samples."""
        if len(self.samples) < 2:
            return None
        (t0, b0), (t1, b1) = self.samples[0], self.samples[-1]
        return max(0.0, (b1 - b0) / (t1 - t0)) if t1 > t0 else None


@dataclass
class ServedPool:
    spec: PoolSpec
    pool: Pool
    refs: dict[int, str]  # id(device) -> how the node names it: a config device's name or file:PATH:SIZE
    meter: RebuildMeter = field(default_factory=RebuildMeter)

    def held(self) -> list[BlockDevice]:
        """The devices in the pool's slots and its spares now."""
        return [m.dev for m in self.pool.members if m.dev is not None] + [d for d, _ in self.pool.spares]

    def ref(self, dev: BlockDevice) -> str:
        return self.refs.get(id(dev), str(getattr(dev, "name", "?")))


class ServedPools(Mapping[str, ServedPool]):
    """The node's pools by name, over `devices` (the node's opened config devices, name -> device)."""

    def __init__(self, state: StoredState, data_dir: Path, devices: Mapping[str, BlockDevice]) -> None:
        self.state = state
        self.data_dir = data_dir
        self.devices = devices
        self._pools: dict[str, ServedPool] = {}
        self._owned: set[int] = set()             # id() of devices the pools close
        self._loose: list[BlockDevice] = []       # opened for a pool (file:...) but not taken by it
        self._sampler: asyncio.Task[None] | None = None

    def __getitem__(self, name: str) -> ServedPool:
        return self._pools[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    async def assemble(self) -> None:
        """Create or assemble every pool of the config, in order; raises PoolSetupError for one that cannot be
        served (the pools already assembled stay, for close())."""
        for spec in self.state.config.pools:
            self._pools[spec.name] = await self._open_pool(spec)

    def start_meter(self) -> None:
        if self._pools and self._sampler is None:
            self._sampler = asyncio.get_running_loop().create_task(self._sample_rebuilds(), name="pool-meter")

    async def stop_meter(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
            self._sampler = None

    async def close(self) -> frozenset[int]:
        """Close the pools (clean: flushed, superblocks marked clean; they close their members), then the files
        opened for them that none took. Returns id() of every device the pools closed: the node closes the
        rest of its devices, not these a second time."""
        await self.stop_meter()
        for name, sp in reversed(list(self._pools.items())):
            try:
                await sp.pool.close()
                log.info("pool %s: closed", name)
            except Exception as e:  # noqa: BLE001 - one bad pool must not keep the others open
                log.error("pool %s: close failed: %s", name, e)
        self._pools.clear()
        owned = frozenset(self._owned)
        for dev in reversed(self._loose):
            if id(dev) in owned:
                continue
            await flush_and_close(dev, str(getattr(dev, "name", "?")))
        self._loose.clear()
        self._owned.clear()
        return owned

    # --- assembly ---------------------------------------------------------------------------------------------

    async def _open_pool(self, spec: PoolSpec) -> ServedPool:
        """Assemble the pool from whichever of its devices carry its superblock, or create it on first start
        (every member blank). A device that carries another pool's superblock is never written."""
        from openvsan.block.errors import BlockError
        from openvsan.pool import Pool, PoolError
        from openvsan.pool.members import MEMBER_FAULTS
        from openvsan.pool.superblock import read_superblock

        declared = list(spec.members) + list(spec.spares)
        refs: dict[int, str] = {}
        found: list[tuple[str, BlockDevice]] = []
        for ref in declared:
            if ref in self.devices:
                found.append((ref, self.devices[ref]))
        for ref in self.state.pool_devices.get(spec.name, ()):
            dev = self._runtime_device(spec, ref, declared)
            if dev is not None:
                found.append((ref, dev))
        ours: list[BlockDevice] = []
        blank: dict[str, BlockDevice] = {}
        for ref, dev in found:
            refs[id(dev)] = ref
            try:
                sb = await read_superblock(dev)
            except (*MEMBER_FAULTS, OSError) as e:
                log.error("pool %s: %s: cannot read its superblock (%s); leaving it out", spec.name, ref, e)
                continue
            if sb is None:
                blank[ref] = dev
            elif sb.name != spec.name:
                if ref not in declared:
                    log.warning("pool %s: %s now carries pool %r; forgetting it", spec.name, ref, sb.name)
                    continue
                raise PoolSetupError(f"pool {spec.name}: device {ref}{_where(dev)} carries a member of another "
                                     f"pool, {sb.name!r} ({sb.pool_uuid}); refusing to touch it: take it out of the "
                                     "pool's devices, or erase that superblock with `vsan pool destroy`")
            else:
                ours.append(dev)
        rate = float(spec.rebuild_rate) if spec.rebuild_rate else None
        try:
            if not ours:
                missing = [r for r in declared if r not in blank]
                if missing:
                    raise PoolSetupError(f"pool {spec.name}: cannot create it: {', '.join(missing)} cannot be "
                                         "opened or read; mend or replace them in the config")
                # spares are added after create: Pool.create(spares=...) fails on a zip of unequal lengths
                pool = await Pool.create([blank[r] for r in spec.members], spec.level, spec.chunk, name=spec.name,
                                         rebuild_rate=rate)
            else:
                pool = await Pool.assemble(ours, rebuild_rate=rate)
        except (PoolError, BlockError) as e:
            text = _pool_text(e).removeprefix(f"pool {spec.name!r}: ")
            raise PoolSetupError(f"pool {spec.name}: {text}") from None
        sp = ServedPool(spec, pool, refs)
        self._owned.update(id(d) for d in sp.held())
        for ref in spec.spares:
            if ref in blank:
                try:
                    await pool.add_spare(blank[ref])
                except (PoolError, BlockError) as e:
                    log.error("pool %s: spare %s not added: %s", spec.name, ref, _pool_text(e))
                    continue
                self._owned.add(id(blank[ref]))
        for i, ref in enumerate(spec.members):
            if ours and ref in blank:
                log.warning("pool %s: %s (members[%d]) carries no superblock, so it is not used; `vsan pool replace "
                            "%s SLOT %s` rebuilds a missing member onto it", spec.name, ref, i, spec.name, ref)
        self._record_runtime(sp)
        st = pool.status()
        lost = [f"{m.index} ({m.state})" for m in st.members if m.state != "active"]
        log.info("pool %s: %s RAID %d over %d members, %s, chunk %s, %s%s", spec.name,
                 "assembled" if ours else "created", st.level, len(st.members), format_size(st.size),
                 format_size(st.chunk_size), st.state, f": members {', '.join(lost)}" if lost else "")
        return sp

    def _runtime_device(self, spec: PoolSpec, ref: str, declared: list[str]) -> BlockDevice | None:
        """A device the running pool took in earlier (replace, add-spare), named by its ref; None if gone."""
        if ref in declared:
            return None
        if not ref.startswith(FILE_REF):
            user = self.state.config.device_user(ref)
            if ref not in self.devices or user is not None:
                log.warning("pool %s: %s was added to it, but the config %s; leaving it out", spec.name, ref,
                            f"gives it to {user}" if user else "has no such device now")
                return None
            return self.devices[ref]
        path, _ = parse_file_ref(ref)
        try:
            # never create it: a file that is gone is a missing member
            dev = FileDevice(path, name=str(path), trust_foreign=self.state.config.node.trust_foreign_files)
        except (OSError, ValueError) as e:
            log.error("pool %s: %s: cannot open it: %s; leaving it out", spec.name, ref, why(e))
            return None
        self._loose.append(dev)
        return dev

    def _record_runtime(self, sp: ServedPool) -> None:
        """Remember which devices the pool holds beyond the config's, so the next start finds them."""
        declared = set(sp.spec.members) | set(sp.spec.spares)
        extra = [sp.ref(d) for d in sp.held() if sp.ref(d) not in declared]
        name = sp.spec.name

        def recorded(f: Any) -> None:
            if (e := f.exception()) is not None:  # the pool runs on; only the next start would miss the device
                log.error("pool %s: cannot record its devices in %s: %s", name, STATE_DB, e)

        # on the store's writer thread, in order: the event loop does not wait for the commit's fsync
        record_pool_devices(self.data_dir, name, extra).add_done_callback(recorded)

    async def _sample_rebuilds(self) -> None:
        while True:
            for sp in self._pools.values():
                sp.meter.sample(sp.pool)
            await asyncio.sleep(1.0)

    # --- control socket commands ------------------------------------------------------------------------------

    async def control(self, cmd: str, args: dict[str, Any]) -> Any:
        """A `pool.*` command from the control socket (node/control.py, through `Node.control`): what `vsan pool ...`
        calls."""
        handler = {
            "pool.list": self._pool_list, "pool.status": self._pool_status, "pool.scrub": self._pool_scrub,
            "pool.fail": self._pool_fail, "pool.replace": self._pool_replace, "pool.add_spare": self._pool_add_spare,
        }.get(cmd)
        if handler is None:
            raise RequestError(f"unknown command {cmd!r}")
        try:
            return await handler(args)
        except RequestError:
            raise
        except ValueError as e:  # PoolError among them
            raise RequestError(_pool_text(e)) from None

    def _served(self, args: dict[str, Any]) -> ServedPool:
        name = args.get("name")
        if name not in self._pools:
            known = ", ".join(self._pools) or "none is configured"
            raise NotFound(f"no pool {name!r}; pools: {known}")
        return self._pools[name]

    def _device_for(self, sp: ServedPool, ref: str) -> tuple[BlockDevice, bool]:
        """The device `ref` names for a replace or spare: a config device in no use, or file:PATH:SIZE (opened,
        created if missing). Returns it and whether it was opened just now (to close if the pool refuses it)."""
        cfg = self.state.config
        held = {id(d): (name, s.ref(d)) for name, s in self._pools.items() for d in s.held()}
        if ref.startswith(FILE_REF):
            path, size = parse_file_ref(ref)
            for spec in cfg.devices:
                if spec.path is not None and spec.path.resolve() == path.resolve():
                    raise RequestError(f"{path} is device {spec.name} in the config; name it: {spec.name}")
            for name, s in self._pools.items():
                for d in s.held():
                    if isinstance(d, FileDevice) and d.path.resolve() == path.resolve():
                        raise RequestError(f"{path} is already in pool {name}")
            try:
                fdev = FileDevice(path, size=size, block_size=sp.pool.block_size, name=str(path),
                                  trust_foreign=cfg.node.trust_foreign_files)
            except (OSError, ValueError) as e:
                raise RequestError(f"{ref}: {why(e)}") from None
            sp.refs[id(fdev)] = ref if size is not None else f"{FILE_REF}{path}"
            return fdev, True
        if not any(d.name == ref for d in cfg.devices):
            known = [d.name for d in cfg.devices if cfg.device_user(d.name) is None]
            raise RequestError(f"unknown device {ref!r}; name a config device in no use ({', '.join(known) or 'none'})"
                               " or a file: file:PATH:SIZE")
        user = cfg.device_user(ref)
        if user is not None and user != f"pool {sp.spec.name}":
            raise RequestError(f"device {ref} belongs to {user} in the config; pick a device in no use")
        if ref not in self.devices:
            raise RequestError(f"device {ref} could not be opened when vsan serve started (see its log)")
        dev = self.devices[ref]
        if id(dev) in held:
            pool, _ = held[id(dev)]
            raise RequestError(f"device {ref} is already in pool {pool}")
        sp.refs[id(dev)] = ref
        return dev, False

    async def _pool_list(self, args: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for name, sp in self._pools.items():
            st = sp.pool.status()
            volume = next((v.name for v in self.state.config.volumes if v.pool == name), None)
            out.append({"name": name, "level": st.level, "state": st.state, "size": st.size,
                        "members": len(st.members), "spares": len(st.spares), "volume": volume,
                        "rebuild_progress": st.rebuild_progress, "resync_progress": st.resync_progress})
        return out

    async def _pool_status(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        sp.meter.sample(sp.pool)
        st = sp.pool.status().as_dict()
        for m in st["members"]:
            dev = sp.pool.members[m["index"]].dev
            m["device"] = sp.ref(dev) if dev is not None else None
        st["spares"] = [sp.ref(d) for d, _ in sp.pool.spares]
        st["rebuild_rate_limit"] = sp.pool.rebuild_rate
        st["rebuild_speed"] = sp.meter.rate() if st["rebuild_progress"] is not None else None
        return st

    async def _pool_scrub(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        report = await sp.pool.scrub(repair=bool(args.get("repair", True)))
        log.info("pool %s: scrub: %d stripes checked, %d mismatches, %d repaired, %d unrepairable", sp.spec.name,
                 report.checked, report.mismatches, report.repaired, report.unrepairable)
        return report.as_dict()

    def _member_index(self, sp: ServedPool, member: object) -> int:
        if isinstance(member, int) or (isinstance(member, str) and member.isdigit()):
            return int(member)
        for m in sp.pool.members:
            if m.dev is not None and member in (sp.ref(m.dev), m.name):
                return m.index
        names = ", ".join(f"{m.index}: {sp.ref(m.dev)}" for m in sp.pool.members if m.dev is not None)
        raise RequestError(f"pool {sp.spec.name} has no member {member!r}; give a slot number or a name ({names})")

    async def _pool_fail(self, args: dict[str, Any]) -> dict[str, Any]:
        from openvsan.pool.superblock import MemberState

        sp = self._served(args)
        pool = sp.pool
        i = self._member_index(sp, args.get("member"))
        if not 0 <= i < len(pool.members):
            raise RequestError(f"no member {i}: pool {sp.spec.name} has members 0..{len(pool.members) - 1}")
        m = pool.members[i]
        if m.state not in (MemberState.ACTIVE, MemberState.REBUILDING):
            raise RequestError(f"member {i} ({m.name}) is already {m.state.name.lower()}")
        lost = [x.index for x in pool.members if x.state is not MemberState.ACTIVE] + [i]
        if not pool.geo.available(lost):
            raise RequestError(f"failing member {i} would leave pool {sp.spec.name} without members "
                               f"{sorted(set(lost))}, more than RAID {int(pool.level)} tolerates "
                               f"({pool.geo.tolerance}); replace a failed member first")
        who = m.name
        await pool.fail_member(i)
        log.warning("pool %s: member %d (%s) failed by request", sp.spec.name, i, who)
        return await self._pool_status({"name": sp.spec.name})

    async def _pool_replace(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        index = args.get("index")
        if not isinstance(index, int):
            raise RequestError(f"index must be a member slot number, not {index!r}")
        dev, opened = self._device_for(sp, str(args.get("device", "")))
        try:
            await sp.pool.replace(index, dev, force=bool(args.get("force", False)))
        except BaseException:
            if opened:
                await dev.close()
            raise
        self._took(sp, dev)
        sp.meter.sample(sp.pool)  # the rebuild's starting point
        log.warning("pool %s: member %d replaced by %s; rebuilding", sp.spec.name, index, sp.ref(dev))
        return await self._pool_status({"name": sp.spec.name})

    async def _pool_add_spare(self, args: dict[str, Any]) -> dict[str, Any]:
        sp = self._served(args)
        dev, opened = self._device_for(sp, str(args.get("device", "")))
        try:
            await sp.pool.add_spare(dev, force=bool(args.get("force", False)))
        except BaseException:
            if opened:
                await dev.close()
            raise
        self._took(sp, dev)
        log.info("pool %s: spare %s added", sp.spec.name, sp.ref(dev))
        return await self._pool_status({"name": sp.spec.name})

    def _took(self, sp: ServedPool, dev: BlockDevice) -> None:
        self._owned.add(id(dev))  # the pool closes it from now on
        self._record_runtime(sp)


def _where(dev: BlockDevice) -> str:
    return f" ({dev.path})" if isinstance(dev, FileDevice) else ""


def _pool_text(e: BaseException) -> str:
    # the pool library speaks of its Python argument; a user of the node or the CLI passes --force
    text = str(e).replace("pass force=True", "pass --force").replace("force=True", "--force")
    return text.replace("(fail_member)", "(vsan pool fail)")


def why(e: BaseException) -> str:
    """One line for the user: an OSError's file and strerror, not Python's "[Errno 2] ..."."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


async def flush_and_close(dev: BlockDevice, name: str) -> None:
    """Flush and close one device at stop; a failure is logged, so one bad device cannot keep the others
    unflushed."""
    try:
        await dev.flush()
        await dev.close()
    except Exception as e:  # noqa: BLE001 - see above
        log.error("device %s: flush/close failed: %s", name, e)
