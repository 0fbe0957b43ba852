"""The ``ucm-ray`` command: run the shard fleet, inspect it, run the demo."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time

from ucm_ray.config import ConfigError, UcmRayConfig

log = logging.getLogger("ucm_ray")


def _connect(args: argparse.Namespace, cfg: UcmRayConfig) -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if args.local:
        # A private cluster: on loopback, never reachable from other hosts.
        ray.init(namespace=cfg.ray_namespace, include_dashboard=False, logging_level="WARNING",
                 _node_ip_address="127.0.0.1")
        return
    try:
        ray.init(address=args.address or "auto", namespace=cfg.ray_namespace, logging_level="WARNING")
    except ConnectionError as e:
        raise SystemExit(f"ucm-ray: no Ray cluster at {args.address or 'auto'} ({e}); start one with "
                         "`ray start --head`, pass --address, or use --local") from None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def cmd_up(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    from ucm_ray.store.shard.fleet import fleet_status, start_fleet

    _connect(args, cfg)
    if args.local:
        return _serve_local(cfg)
    start_fleet(cfg)
    print(json.dumps(fleet_status(cfg), indent=2))
    return 0


def _serve_local(cfg: UcmRayConfig) -> int:
    """The cluster lives in this process: serve until Ctrl-C or SIGTERM (what Kubernetes and
    systemd send), then stop the fleet, unlinking its pools, and the cluster; exit 0 either way.
    SIGTERM replaces Ray's own handler, which exited 1 (or died of the signal) leaving the pools
    in /dev/shm; SIGINT gets the same handler, since a process a script starts in the background
    inherits SIGINT ignored and Python then installs no KeyboardInterrupt handler (``kill -INT``
    did nothing). A signal during start-up stops what had started."""
    import ray

    from ucm_ray.store.shard.fleet import fleet_status, start_fleet, stop_fleet

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        start_fleet(cfg)
        print(json.dumps(fleet_status(cfg), indent=2), flush=True)
        log.info("local fleet running; Ctrl-C or SIGTERM stops it")
        while True:
            time.sleep(30)
            log.info("status: %s", _summary(fleet_status(cfg)))
    except KeyboardInterrupt as e:
        log.info("%s: stopping the local fleet", e.args[0] if e.args else "SIGINT")
    finally:
        # A second signal must not cut the clean-up short (SIGKILL still can).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stop_fleet(cfg)
        except Exception as e:  # noqa: BLE001 -- never hide why we are stopping
            log.warning("the local fleet did not stop cleanly: %s", e)
        ray.shutdown()
    return 0


def cmd_status(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    from ucm_ray.store.shard.fleet import fleet_status

    _connect(args, cfg)
    try:
        st = fleet_status(cfg)
    except ValueError:
        print(f"no ucm-ray fleet in Ray namespace {cfg.ray_namespace!r}", file=sys.stderr)
        return 1
    for shard in st["shards"]:
        if "error" not in shard:
            shard["hit_rate"] = shard["hits"] / shard["lookups"] if shard["lookups"] else None
    print(json.dumps(st, indent=2) if args.json else status_table(st))
    return 0


def cmd_down(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    """Stops the shards and unlinks their pools; the disk tier's files stay (the next ``up``
    adopts their entries) unless ``--purge-disk``."""
    from ucm_ray.store.shard.fleet import purge_disk_everywhere, stop_fleet

    if args.purge_disk and not cfg.disk_roots:
        print("ucm-ray: --purge-disk needs the fleet's disk_dir (pass the config `up` was given)", file=sys.stderr)
        return 2
    _connect(args, cfg)
    print(f"stopped {stop_fleet(cfg)} shard(s)")
    if args.purge_disk:
        print(f"purged the disk tier files of {purge_disk_everywhere(cfg)} shard(s)")
    return 0


def cmd_serve(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    """Check a Serve config the way the app builder will, then hand over to ``serve run``:
    a mistake is one line here instead of a traceback in Serve's controller log."""
    from ucm_ray.serve.check import check_serve_config

    try:
        endpoint = check_serve_config(args.config_file)
    except ConfigError as e:
        print(f"ucm-ray: bad Serve config {args.config_file}: {e}", file=sys.stderr)
        return 2
    log.info("starting; engines take a minute or two. Then: curl %s/v1/models, or the OpenAI client with "
             "base_url=%s/v1. Ctrl-C stops it.", endpoint, endpoint)
    command = [sys.executable, "-m", "ray.serve.scripts", "run", args.config_file]
    if args.address:
        command += ["--address", args.address]
    sys.stdout.flush()
    # ``serve run`` stops its apps on KeyboardInterrupt, which Python raises only if SIGINT was
    # not ignored when it started: a script's background job (``ucm-ray serve ... &``) inherits
    # it ignored, and ``kill -INT`` did nothing (the exec keeps an ignored signal ignored)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.execv(sys.executable, command)
    return 0  # not reached


def cmd_make_tiny_model(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    from ucm_ray.tiny_model import make_tiny_model

    print(make_tiny_model(args.dir))
    return 0


def cmd_demo(args: argparse.Namespace, cfg: UcmRayConfig) -> int:
    from ucm_ray.demo import run_demo

    summary = run_demo(args.model_dir, num_requests=args.requests, prefix_tokens=args.prefix_tokens)
    return 0 if summary["outputs_identical"] and summary["hit_tokens"] > 0 else 1


def _summary(st: dict) -> str:
    lines = [f"membership v{st['version']}, {len(st['shards'])} shard(s)"]
    for s in st["shards"]:
        if "error" in s:
            lines.append(f"  {s['shard_id']}: {s['error']}")
            continue
        hit = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        lines.append(f"  {s['shard_id']}: {s['used_bytes'] / 2**20:.1f}/{s['capacity_bytes'] / 2**20:.0f} MiB, "
                     f"{s['entries']} entries, hit rate {hit:.2f}, {s['evictions']} evictions, "
                     f"{s['dropped_saves']} dropped saves")
    return "\n".join(lines)


def _bytes(n: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


STATUS_COLUMNS = ("SHARD", "NODE", "ENTRIES", "USED / CAPACITY", "USE", "HIT RATE", "LOOKUPS", "EVICTIONS",
                  "DROPPED SAVES")


def status_table(st: dict) -> str:
    """``ucm-ray status``: one row per shard. NODE is the node's IP and the start of its Ray node
    id; HIT RATE is keys found / keys readers asked for (since the shard started); DISK (only
    when a shard runs a disk tier) its used / capacity and how many entries it promoted."""
    with_disk = any("disk_capacity_bytes" in s for s in st["shards"])
    columns = STATUS_COLUMNS + (("DISK USED / CAPACITY", "DISK PROMOTED") if with_disk else ())
    rows: list[tuple[str, ...]] = []
    for s in st["shards"]:
        if "error" in s:
            rows.append((s["shard_id"], "?", "-", f"unreachable: {s['error']}") + ("",) * (len(columns) - 4))
            continue
        node = f"{s.get('node_ip', '?')} {s['node_id'][:8]}"
        use = s["used_bytes"] / s["capacity_bytes"] if s["capacity_bytes"] else 0.0
        hit = f"{s['hits'] / s['lookups']:.2f}" if s["lookups"] else "-"
        used = f"{_bytes(s['used_bytes'])} / {_bytes(s['capacity_bytes'])}"
        row: tuple[str, ...] = (s["shard_id"], node, str(s["entries"]), used, f"{use:.0%}", hit, str(s["lookups"]),
                                str(s["evictions"]), str(s["dropped_saves"]))
        if with_disk:
            row += _disk_cells(s)
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [f"membership v{st['version']}, {len(st['shards'])} shard(s)",
             "  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _disk_cells(s: dict) -> tuple[str, str]:
    if "disk_capacity_bytes" not in s:
        return "-", "-"
    if not s["disk_enabled"]:
        return f"off ({s['disk_io_errors']} I/O errors)", str(s["disk_promoted"])
    return f"{_bytes(s['disk_used_bytes'])} / {_bytes(s['disk_capacity_bytes'])}", str(s["disk_promoted"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ucm-ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, helptext in [
        ("up", cmd_up, "start the directory and shards (idempotent)"),
        ("status", cmd_status, "show shards, capacity and hit counts"),
        ("down", cmd_down, "stop the shards and unlink their pools"),
    ]:
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("--address", help="Ray cluster address (default: auto)")
        sp.add_argument("--local", action="store_true", help="start a private local Ray cluster")
        if name == "status":
            sp.add_argument("--json", action="store_true",
                            help="every figure per shard as JSON (plus hit_rate), for scripts")
        if name == "down":
            sp.add_argument("--purge-disk", action="store_true",
                            help="also delete the disk tier's files under disk_dir (kept otherwise: the "
                                 "next `up` adopts them)")
        UcmRayConfig.add_cli_arguments(sp)
        sp.set_defaults(func=fn)
    sp = sub.add_parser("serve", help="check a Serve config file, then `serve run` it")
    sp.add_argument("config_file", help="e.g. deploy/serve/tiny-cpu.yaml")
    sp.add_argument("--address", help="Ray cluster address (default: what `serve run` picks)")
    sp.set_defaults(func=cmd_serve, config=None)
    sp = sub.add_parser("demo", help="two local engines share a fleet: cold vs warm TTFT")
    sp.add_argument("--model-dir", default=None, help="tiny model directory (built if missing)")
    sp.add_argument("--requests", type=int, default=3)
    sp.add_argument("--prefix-tokens", type=int, default=3072)
    sp.set_defaults(func=cmd_demo)
    sp = sub.add_parser("make-tiny-model", help="build the tiny local test model into DIR")
    sp.add_argument("dir")
    sp.set_defaults(func=cmd_make_tiny_model, config=None)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        cfg = UcmRayConfig.from_cli(args) if hasattr(args, "num_shards") else UcmRayConfig()
    except ConfigError as e:
        print(f"ucm-ray: bad configuration: {e}", file=sys.stderr)
        return 2
    return args.func(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
