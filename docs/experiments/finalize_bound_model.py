# A host model of the CUDA indexer's finalize bound (src/attn/cuda/indexer_finalize.cu)
# for one token: how many keys pass the lists' bound alone, and how many pass the bound
# refine_bound raises from the lists' first keys (commit 17d2f82), on score
# patterns: i.i.d. (the step benchmark's synthetic caches), all keys tied (one score,
# ties to the lower j), few distinct values, a trend with position, a few hot tiles.
# Units are contiguous ranges of keys; each unit's list is its best k keys sorted
# best first; a list's bound is its m-th key, m = ceil(k / units). It asserts that
# the keys passing the new bound hold the true best k. Usage: python3 THIS_FILE
# (docs/perf-notes.md, forty-ninth session).
# sorted best first; list bound = its m-th key, m = ceil(k / units).
import random, math
K, STAGE, SORT = 512, 3072, 2048
def order_key(score, j):  # bigger is better; ties to the lower j
    return (score, -j)
def run(scores, units, k=K, rounds=4):
    n = len(scores); per_unit = math.ceil(n / units)
    keys = [order_key(s, j) for j, s in enumerate(scores)]
    lists = []
    for u in range(units):
        ks = sorted(keys[u * per_unit:(u + 1) * per_unit], reverse=True)[:k]
        lists.append(ks)
    m = math.ceil(k / units)
    lo = min(l[m - 1] if len(l) >= m else (-1e30, 0) for l in lists)
    old_n = sum(1 for l in lists for x in l if x >= lo)
    # refine_bound
    live = list(range(units)); per = min(k, STAGE // units); rnd = 0
    while rnd < rounds and live:
        staged = [x for s in live for x in lists[s][:per] if x >= lo]
        if len(staged) < k: break
        t = sorted(staged, reverse=True)[k - 1]
        lo = max(lo, t)
        live = [s for s in live if len(lists[s]) > per and lists[s][per - 1] >= lo]
        per = min(k, STAGE // max(len(live), 1)); rnd += 1
    cand = [x for l in lists for x in l if x >= lo]
    true_top = sorted(keys, reverse=True)[:k]
    assert set(true_top) <= set(cand), "lost a pick"
    return old_n, len(cand), rnd
random.seed(1)
n = 262144
for name, sc in [
    ("iid", [random.random() for _ in range(n)]),
    ("all tie", [1.0] * n),
    ("few values (bf16-like runs)", [round(random.gauss(0, 0.01), 3) for _ in range(n)]),
    ("trend (newer better)", [j / n + random.gauss(0, 0.01) for j in range(n)]),
    ("crowded (8 hot tiles)", [1.0 if (j // 64) % 512 == 7 else random.random() for j in range(n)]),
]:
    print(f"{name:30s} old candidates, new candidates, rounds:", run(sc, 128))
print("-- other shapes")
for n, units, k in [(16384, 128, 512), (16384, 32, 512), (65536, 128, 1024), (262144, 128, 1024), (8192, 4, 512)]:
    for name, sc in [("all tie", [1.0] * n), ("trend", [j / n + random.gauss(0, 0.01) for j in range(n)]),
                     ("iid", [random.random() for _ in range(n)])]:
        print(f"n {n:6d} units {units:3d} k {k:4d} {name:6s}:", run(sc, units, k))
