"""Store throughput: fmstore's POSIX and S3 stores against the floor and the peers, one run.

    python -m benchmarks.stores [--total-mib 1024] [--dir PATH] [--no-s3]

Writes and reads TOTAL as 16 equal objects and as one object:
* POSIX: PosixStore (buffered + fdatasync, and O_DIRECT) vs the floor (one large-block
  write + fsync, and an O_DIRECT write of the same bytes); reads cold (page cache dropped)
  vs a plain large-block cold read.
* S3 (a SeaweedFS started here): S3Store vs boto3 upload_fileobj/download_fileobj with
  8 threads, s3fs, and s3torchconnector's client, all on the same server.
Ratios are fmstore / peer throughput (higher is better).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import mmap
import os
import shutil
import tempfile
import time
from typing import Any

from benchmarks.common import drop_caches, have, mbps, print_table, save_json
from fmstore import runtime
from fmstore.stores import PosixOptions, PosixStore

BLOCK = 64 << 20


def floor_write_buffered(path: str, data: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for off in range(0, len(data), BLOCK):
            os.write(fd, data[off : off + BLOCK])
        os.fsync(fd)
    finally:
        os.close(fd)


def floor_write_direct(path: str, data: memoryview) -> None:
    buf = mmap.mmap(-1, BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        for off in range(0, len(data), BLOCK):
            n = min(BLOCK, len(data) - off)
            buf[:n] = data[off : off + n]
            os.write(fd, memoryview(buf)[:n])
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def floor_read(path: str) -> int:
    n = 0
    buf = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while True:
            r = f.readinto(buf)
            if not r:
                return n
            n += r


def posix_rows(root: str, total: int) -> list[dict[str, Any]]:
    data = memoryview(os.urandom(16 << 20) * (total >> 24))
    pieces = [data[i * total // 16 : (i + 1) * total // 16] for i in range(16)]
    rows: list[dict[str, Any]] = []

    def clean() -> None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)

    clean()

    def measure(label: str, fn) -> float:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{root}/f")  # the floor's file; store objects are overwritten in place
        os.sync()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        rows.append({"op": "write", "what": label, "MB/s": mbps(total, dt)})
        return dt

    fb = measure("floor: write+fsync, 1 file", lambda: floor_write_buffered(f"{root}/f", data))
    fd = measure("floor: O_DIRECT write, 1 file", lambda: floor_write_direct(f"{root}/f", data))
    best_floor = min(fb, fd)
    for direct in (False, True):
        store = PosixStore(root, options=PosixOptions(direct_io=direct))
        tag = "O_DIRECT" if direct else "buffered+fdatasync"
        one = measure(
            f"PosixStore {tag}, 1 object", lambda s=store: runtime.run(s.put("one", data))
        )

        async def many(s=store) -> None:
            await asyncio.gather(*(s.put(f"part/{i:02d}", p) for i, p in enumerate(pieces)))

        sixteen = measure(f"PosixStore {tag}, 16 objects", lambda: runtime.run(many()))
        rows[-2]["vs floor"] = best_floor / one
        rows[-1]["vs floor"] = best_floor / sixteen

    # cold reads: the 16 objects and the single object written last
    def cold(label: str, fn) -> float:
        cold_ok = drop_caches()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        rows.append(
            {"op": "read" + ("" if cold_ok else " (warm!)"), "what": label, "MB/s": mbps(total, dt)}
        )
        return dt

    store = PosixStore(root)
    floor = cold("floor: large-block read, 1 file", lambda: floor_read(f"{root}/one"))
    one = cold("PosixStore get, 1 object", lambda: runtime.run(store.get("one")))
    rows[-1]["vs floor"] = floor / one

    async def read_many() -> None:
        await asyncio.gather(*(store.get(f"part/{i:02d}") for i in range(16)))

    sixteen = cold("PosixStore get, 16 objects", lambda: runtime.run(read_many()))
    rows[-1]["vs floor"] = floor / sixteen
    clean()
    return rows


def s3_rows(total: int) -> list[dict[str, Any]]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    from fmstore.stores import open_store
    from fmstore.testing.seaweed import SeaweedServer

    data = os.urandom(16 << 20) * (total >> 24)
    pieces = [data[i * total // 16 : (i + 1) * total // 16] for i in range(16)]
    rows: list[dict[str, Any]] = []
    with SeaweedServer() as srv:
        bucket = "bench"
        srv.create_bucket(bucket)
        opts = srv.store_options()
        store = open_store(f"s3://{bucket}/fm", **opts)
        client = boto3.client("s3", **srv.client_kwargs())
        tcfg = TransferConfig(
            max_concurrency=8, multipart_chunksize=16 << 20, multipart_threshold=16 << 20
        )

        results: dict[tuple[str, str, str], float] = {}

        def rec(op: str, shape: str, who: str, fn) -> None:
            t0 = time.perf_counter()
            fn()
            results[(op, shape, who)] = time.perf_counter() - t0

        # --- fmstore
        rec("upload", "1 object", "fmstore", lambda: runtime.run(store.put("one", data)))

        async def put16() -> None:
            await asyncio.gather(*(store.put(f"p/{i}", p) for i, p in enumerate(pieces)))

        async def get16() -> None:
            await asyncio.gather(*(store.get(f"p/{i}") for i in range(16)))

        rec("upload", "16 objects", "fmstore", lambda: runtime.run(put16()))
        rec("download", "1 object", "fmstore", lambda: runtime.run(store.get("one")))
        rec("download", "16 objects", "fmstore", lambda: runtime.run(get16()))

        # --- boto3 transfer manager, 8 threads
        from concurrent.futures import ThreadPoolExecutor

        rec(
            "upload",
            "1 object",
            "boto3",
            lambda: client.upload_fileobj(io.BytesIO(data), bucket, "b/one", Config=tcfg),
        )

        def b16(fn) -> None:
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(fn, range(16)))

        rec(
            "upload",
            "16 objects",
            "boto3",
            lambda: b16(
                lambda i: client.upload_fileobj(
                    io.BytesIO(pieces[i]), bucket, f"b/p/{i}", Config=tcfg
                )
            ),
        )
        rec(
            "download",
            "1 object",
            "boto3",
            lambda: client.download_fileobj(bucket, "b/one", io.BytesIO(), Config=tcfg),
        )
        rec(
            "download",
            "16 objects",
            "boto3",
            lambda: b16(
                lambda i: client.download_fileobj(bucket, f"b/p/{i}", io.BytesIO(), Config=tcfg)
            ),
        )

        if have("s3fs"):
            import s3fs

            fs = s3fs.S3FileSystem(
                key=srv.access_key,
                secret=srv.secret_key,
                endpoint_url=srv.endpoint_url,
                client_kwargs={"region_name": srv.region},
            )
            rec("upload", "1 object", "s3fs", lambda: fs.pipe_file(f"{bucket}/s/one", data))
            rec(
                "upload",
                "16 objects",
                "s3fs",
                lambda: fs.pipe({f"{bucket}/s/p/{i}": p for i, p in enumerate(pieces)}),
            )
            rec("download", "1 object", "s3fs", lambda: fs.cat_file(f"{bucket}/s/one"))
            rec(
                "download",
                "16 objects",
                "s3fs",
                lambda: fs.cat([f"{bucket}/s/p/{i}" for i in range(16)]),
            )
        if have("s3torchconnector"):
            os.environ.update(srv.env())
            from s3torchconnector._s3client import S3Client, S3ClientConfig

            c = S3Client(
                region=srv.region,
                endpoint=srv.endpoint_url,
                s3client_config=S3ClientConfig(force_path_style=True),
            )

            def st_put(key: str, blob: bytes) -> None:
                w = c.put_object(bucket, key)
                w.write(blob)
                w.close()

            rec("upload", "1 object", "s3torchconnector", lambda: st_put("t/one", data))
            rec(
                "upload",
                "16 objects",
                "s3torchconnector",
                lambda: b16(lambda i: st_put(f"t/p/{i}", pieces[i])),
            )
            rec(
                "download",
                "1 object",
                "s3torchconnector",
                lambda: c.get_object(bucket, "t/one").read(),
            )
            rec(
                "download",
                "16 objects",
                "s3torchconnector",
                lambda: b16(lambda i: c.get_object(bucket, f"t/p/{i}").read()),
            )
        runtime.run(store.close())

    for op in ("upload", "download"):
        for shape in ("1 object", "16 objects"):
            ours = results[(op, shape, "fmstore")]
            row: dict[str, Any] = {"op": op, "what": shape, "fmstore MB/s": mbps(total, ours)}
            for peer in ("boto3", "s3fs", "s3torchconnector"):
                t = results.get((op, shape, peer))
                if t is not None:
                    row[f"{peer} MB/s"] = mbps(total, t)
                    row[f"x {peer}"] = t / ours
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--total-mib", type=int, default=1024)
    ap.add_argument(
        "--dir", default=None, help="directory on the disk to measure (default: a temp dir)"
    )
    ap.add_argument("--no-s3", action="store_true")
    args = ap.parse_args()
    total = args.total_mib << 20
    root = args.dir or tempfile.mkdtemp(prefix="fmstore-bench-")
    out: dict[str, Any] = {"total_bytes": total}
    rows = posix_rows(os.path.join(root, "posix"), total)
    out["posix"] = rows
    print_table(
        f"PosixStore vs floor ({args.total_mib} MiB)", rows, ["op", "what", "MB/s", "vs floor"]
    )
    if not args.no_s3:
        srows = s3_rows(total)
        out["s3"] = srows
        cols = [
            "op",
            "what",
            "fmstore MB/s",
            "boto3 MB/s",
            "x boto3",
            "s3fs MB/s",
            "x s3fs",
            "s3torchconnector MB/s",
            "x s3torchconnector",
        ]
        print_table(f"S3Store vs peers on SeaweedFS ({args.total_mib} MiB)", srows, cols)
    save_json("stores", out)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
