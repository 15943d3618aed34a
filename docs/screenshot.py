"""Take the README's picture of a report: the top of a run's `report.html`, rendered by headless Chromium.

    python docs/screenshot.py [RUN_DIR] [--out docs/images/report.png]

RUN_DIR is a run directory holding `report.html`; without one, `stagereplay paper` (the embedded toy, a few
minutes on a CPU) runs into a temporary folder first. Chromium is Debian's (`apt-get install -y chromium`),
started with a fresh profile and nothing that reaches the network, so it works on a machine without one. The
report is self-contained (its figure is inline), so a `file://` URL renders all of it. When Pillow is
installed the PNG is cropped between two sections and cut to a palette, which keeps it small; otherwise it is
Chromium's PNG as written.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
# Without these, a headless Chromium on a machine with no network waits on its update, sync and QUIC probes,
# and a profile left over from another run can lock it.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars"]


def run_paper(into: Path) -> Path:
    """`stagereplay paper` into a fresh folder under `into`; returns the run directory."""
    run = into / "paper"
    exe = shutil.which("stagereplay") or str(Path(sys.executable).with_name("stagereplay"))
    subprocess.run([exe, "paper", "--out", str(run)], check=True)
    return run


def render(report: Path, out: Path, width: int, height: int, chromium: str) -> None:
    """Chromium's screenshot of `report` at a window of width x height pixels, written to `out`."""
    with tempfile.TemporaryDirectory(prefix="stagereplay-chromium-") as profile:
        cmd = [chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={out}", report.resolve().as_uri()]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    if not out.is_file():
        raise SystemExit(f"chromium wrote no {out}; run it by hand to see why: {' '.join(cmd)}")


def shrink(png: Path, colors: int, gap: int = 24) -> None:
    """Crop the picture at the last blank band of `gap` rows before the window's bottom edge, so that it ends
    between two sections rather than through one, and cut it to a palette of `colors` colours (the report is
    flat colours and text); only if Pillow is installed."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as image:
        rgb = image.convert("RGB")
    gray = rgb.convert("L")
    blank = [gray.crop((0, y, gray.width, y + 1)).getextrema()[0] >= 245 for y in range(gray.height)]
    end = max((y + 1 for y, b in enumerate(blank) if not b), default=gray.height)  # below: blank page
    run, cut = 0, end
    for y in range(end - 1, -1, -1):  # from the bottom up: the first band of `gap` blank rows
        run = run + 1 if blank[y] else 0
        if run == gap:
            cut = y + gap // 2
            break
    small = rgb.crop((0, 0, rgb.width, cut)).quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(png, optimize=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", type=Path,
                        help="run directory with report.html (default: `stagereplay paper` into a temporary one)")
    parser.add_argument("--out", type=Path, default=HERE / "images" / "report.png", help="PNG to write")
    parser.add_argument("--width", type=int, default=1280, help="window width, pixels")
    parser.add_argument("--height", type=int, default=1600, help="window height, pixels: how much of the top")
    parser.add_argument("--colors", type=int, default=64, help="palette size when Pillow is installed")
    parser.add_argument("--chromium", default=CHROMIUM, help="Chromium binary (Debian: apt-get install chromium)")
    args = parser.parse_args(argv)

    if shutil.which(args.chromium) is None:
        raise SystemExit(f"no Chromium at {args.chromium}: apt-get install -y chromium, or pass --chromium PATH")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stagereplay-screenshot-") as tmp:
        run = args.run if args.run is not None else run_paper(Path(tmp))
        report = run / "report.html"
        if not report.is_file():
            raise SystemExit(f"{run} holds no report.html: pass a run directory `stagereplay paper` wrote")
        render(report, args.out, args.width, args.height, args.chromium)
    shrink(args.out, args.colors)
    print(f"{args.out}: {args.out.stat().st_size / 1024:.0f} KiB, the top of {report}")


if __name__ == "__main__":
    main()
