"""What the MINLP does that enumeration cannot: the geometry as integer variables.

The compute-optimal geometry (bundled fit, C_model of ascend_superpod's 768 dies for 20 days at the
space's nominal MFU) over integer spaces of growing size (`mosaic.planner.geometry_minlp`):
n_heads = 8 v, v in [1, V]; n_layers in [4, L]; n_experts in [2, E]; top_k in [1, K]; G in
{1, 2, 4, 8} and a shared expert or not. For each space: SCIP's time, status and gap, and, up to
--enumerate-max geometries, the exhaustive listing's time and whether both find the same optimum.

Prints the table and writes minlp_geometry.json (to --out, default benchmarks/results/).
Run: python benchmarks/minlp_geometry.py [--enumerate-max 6e8] [--time-limit 600]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

SPACES = ((8, 32, 64, 4), (16, 128, 256, 8), (16, 512, 512, 16), (16, 1024, 1024, 16))
"""(V, L, E, K) of each space."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--enumerate-max", type=float, default=6e8, help="Largest space listed exhaustively.")
    ap.add_argument("--time-limit", type=float, default=600.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()

    from mosaic.planner import build_problem
    from mosaic.planner import geometry_minlp as gm
    from scaling_fits import load_fit

    law = load_fit(None)
    c_model = build_problem("ascend_superpod").c_model
    band = (math.sqrt(c_model / (6 * 2000)), math.sqrt(c_model / (6 * 5)))
    rows = []
    print(f"compute-optimal geometry, C_model = {c_model:.3g} FLOPs (ascend_superpod, 768 dies, 20 days)")
    for v, layers, experts, k in SPACES:
        space = gm.IntegerSpace(heads_per_kv=(1, v), depth=(4, layers), n_experts=(2, experts), top_k=(1, k),
                                active_params=band)
        ans = gm.solve(space, law, c_model, time_limit_s=args.time_limit)
        row = {"space": {"heads_per_kv": v, "depth": layers, "n_experts": experts, "top_k": k}, "size": space.size(),
               "minlp_s": ans.seconds, "status": ans.status, "gap": ans.gap, "loss": ans.loss,
               "answer": {"d_model": ans.arch.d_model, "n_layers": ans.depth, "n_experts": ans.n_experts,
                          "top_k": ans.top_k, "granularity": ans.structure[0], "n_shared_experts": ans.structure[1]}}
        if space.size() <= args.enumerate_max:
            t0 = time.perf_counter()
            loss, structure, point, passed = gm.enumerate_space(space, law, c_model)
            row.update({"enumerate_s": time.perf_counter() - t0, "passing_rules": passed,
                        "rel_diff": abs(ans.loss - loss) / loss,
                        "same": (ans.structure, (ans.heads_per_kv, ans.depth, ans.n_experts, ans.top_k)) == (structure, point)})
        rows.append(row)
        listing = (f"listing {row['enumerate_s']:.1f} s ({row['passing_rules']:,} pass the rules), same optimum: "
                   f"{row['same']} (loss rel. diff {row['rel_diff']:.1e})" if "enumerate_s" in row else "not listed")
        a = row["answer"]
        print(f"  V{v} L{layers} E{experts} K{k}: {space.size():.3g} geometries; MINLP {ans.seconds:.1f} s "
              f"({ans.status}, gap {ans.gap:.1g}) -> L{a['n_layers']} h{a['d_model']} E{a['n_experts']} k{a['top_k']} "
              f"G{a['granularity']:g} Es{a['n_shared_experts']}, loss {ans.loss:.6f}; {listing}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "minlp_geometry.json").write_text(json.dumps({"c_model": c_model, "rows": rows}, indent=2))
    print(f"wrote {out / 'minlp_geometry.json'}")


if __name__ == "__main__":
    main()
