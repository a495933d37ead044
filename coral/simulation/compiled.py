"""The event loop of `coral.simulation.engine`, compiled (numba) for a plan that stays put: no re-plan, no
availability change, no shedding — every run of a search and of its certification. Same events, same order
(time, then push order), same arithmetic as the Python loop, which stays as the reference (`loop="python"`) and
serves the runs that change plans. State lives in flat arrays: a node, an instance, a path and a router are
indices; `flatten` lays a started `Engine` out, `serve` runs it and writes the record back into its objects.

Pools (event heap, prefill chunks, paths' finishing targets) start small and double: a run that outgrows one
stops with a flag and is run again with the pool doubled, so no bound is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from coral.allocation.plan import class_indices
from coral.simulation.engine import (
    _EPS,
    READY,
    STOPPED,
    DNode,
    Engine,
    Instance,
    PNode,
    Record,
    Stride,
    Trace,
    class_weights,
)
from coral.simulation.kernels import CTX_GRID

_PREFILL, _KV, _PATH = 0, 1, 2  # event kinds
_GRID = np.array(CTX_GRID)
_I = np.int64


@dataclass
class Layout:
    """A started engine as arrays (see the module doc); `pnodes`, `dnodes`, `insts` map indices back."""

    ints: dict[str, np.ndarray]
    floats: dict[str, np.ndarray]
    pnodes: list[PNode]
    dnodes: list[DNode]
    insts: list[Instance]


def flatten(engine: Engine) -> Layout:
    """Lay out the instances, nodes, routers and requests of `engine` after its initial plan is applied."""
    insts = [i for i in engine.trace.instances if i.state == READY]
    inst_id = {id(i): k for k, i in enumerate(insts)}
    pnodes: list[PNode] = []
    dnodes: list[DNode] = []
    # strides (smooth weighted round-robin) of node pickers and routers share one table
    st_off: list[int] = []
    st_len: list[int] = []
    st_item: list[int] = []
    st_step: list[float] = []
    st_w: list[float] = []

    def stride(items: list[int], steps: list[float], weights: list[float]) -> int:
        st_off.append(len(st_item))
        st_len.append(len(items))
        st_item.extend(items)
        st_step.extend(steps)
        st_w.extend(weights)
        return len(st_off) - 1

    inst_soff: list[int] = []
    inst_ns: list[int] = []
    inst_pbase: list[int] = []
    stage_noff: list[int] = []
    stage_nlen: list[int] = []
    stage_picker: list[int] = []
    stage_mult: list[int] = []
    pn_table: list[float] = []
    pn_toff, pn_cap, pn_last, pn_stage, pn_inst, pn_lpn = [], [], [], [], [], []
    dn_table: list[float] = []
    dn_toff, dn_cap, dn_kvcap, dn_lpn, dn_pcap = [], [], [], [], []
    path_slots = 0
    for k, inst in enumerate(insts):
        decode = inst.phase == "decode"
        inst_soff.append(len(stage_noff))
        inst_ns.append(len(inst.stages))
        sizes = [len(st) for st in inst.stages]
        n_paths = int(np.prod(sizes)) if decode else 0
        inst_pbase.append(path_slots)
        path_slots += n_paths
        mult = 1
        for j, (nodes, picker) in enumerate(zip(inst.stages, inst.pickers, strict=True)):
            stage_noff.append(len(dnodes) if decode else len(pnodes))
            stage_nlen.append(len(nodes))
            stage_picker.append(stride(list(range(len(nodes))), picker.step, picker.step))
            stage_mult.append(mult)
            mult *= len(nodes)
            for n in nodes:
                if decode:
                    dn_toff.append(len(dn_table))
                    dn_table.extend(n.table)
                    dn_cap.append(n.cap)
                    dn_kvcap.append(n.kv_cap)
                    dn_lpn.append(n.layers_per_nic)
                    dn_pcap.append(n_paths // len(nodes))
                    dnodes.append(n)
                else:
                    pn_toff.append(len(pn_table))
                    pn_table.extend(n.table)
                    pn_cap.append(n.cap)
                    pn_last.append(int(n.last))
                    pn_stage.append(j)
                    pn_inst.append(k)
                    pn_lpn.append(n.layers_per_nic)
                    pnodes.append(n)
    # routers: one per (model, phase, request class) with members, as `Engine.pick` builds them
    n = engine.n
    route = np.full((2, n), -1, dtype=_I)
    classes = np.full(n, -1, dtype=_I)  # each request's class, numbered over all models' class names
    names = sorted({c.name for cls in engine.classes.values() for c in cls})
    for model, planned in engine.classes.items():
        if model in engine.models and planned:
            sel = np.flatnonzero(engine.model_of == engine.models.index(model))
            number = np.array([names.index(c.name) for c in planned], dtype=_I)
            classes[sel] = number[class_indices(planned, engine.inp_array[sel])]
    for (model, phase), members in engine.routers.items():
        ids = [inst_id[id(i)] for i in members]
        m = engine.models.index(model)
        sel_model = engine.model_of == m
        for ci, cls in [(-1, None), *enumerate(names)]:
            sel = sel_model & (classes == ci)
            if not sel.any():
                continue
            weights = class_weights(members, cls)
            sid = stride(ids, Stride(ids, weights).step, weights)
            route[int(phase == "decode"), sel] = sid
    p_off = np.zeros(len(dn_pcap) + 1, dtype=_I)
    p_off[1:] = np.cumsum(dn_pcap)
    ints = {
        "st_off": st_off, "st_len": st_len, "st_item": st_item,
        "inst_soff": inst_soff, "inst_ns": inst_ns, "inst_pbase": inst_pbase,
        "stage_noff": stage_noff, "stage_nlen": stage_nlen, "stage_picker": stage_picker, "stage_mult": stage_mult,
        "pn_toff": pn_toff, "pn_cap": pn_cap, "pn_last": pn_last, "pn_stage": pn_stage, "pn_inst": pn_inst,
        "dn_toff": dn_toff, "dn_cap": dn_cap, "dn_poff": p_off[:-1], "dn_pcap": dn_pcap,
        "inp": engine.inp_array, "out": engine.out_array, "route_p": route[0], "route_d": route[1],
        "path_slots": [path_slots],
    }
    floats = {
        "st_step": st_step, "st_w": st_w,
        "pn_table": pn_table, "pn_lpn": pn_lpn, "dn_table": dn_table, "dn_kvcap": dn_kvcap, "dn_lpn": dn_lpn,
        "arr": engine.arrival, "kv_in": engine.kv_in_array, "kv_res": engine.kv_res_array,
        "d_ctx": engine.d_ctx_array, "grid": _GRID,
    }
    return Layout(
        ints={k: np.asarray(v, dtype=_I) for k, v in ints.items()},
        floats={k: np.asarray(v, dtype=np.float64) for k, v in floats.items()},
        pnodes=pnodes, dnodes=dnodes, insts=insts,
    )


# --- heaps: events by (time, push order), a path's sequences by (finishing target, request) ----------------
@njit(cache=True)
def _push(ev_t: Any, ev_s: Any, ev_k: Any, ev_a: Any, ev_b: Any, sc: Any, t: float, kind: int, a: int,
          b: int) -> None:
    n = sc[0]
    if n == len(ev_t):
        sc[6] = 1
        return
    sc[1] += 1
    seq = sc[1]
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if ev_t[p] < t or (ev_t[p] == t and ev_s[p] < seq):
            break
        ev_t[i], ev_s[i], ev_k[i], ev_a[i], ev_b[i] = ev_t[p], ev_s[p], ev_k[p], ev_a[p], ev_b[p]
        i = p
    ev_t[i], ev_s[i], ev_k[i], ev_a[i], ev_b[i] = t, seq, kind, a, b
    sc[0] = n + 1


@njit(cache=True)
def _pop(ev_t: Any, ev_s: Any, ev_k: Any, ev_a: Any, ev_b: Any, sc: Any) -> None:
    """Remove the root (read it before)."""
    n = sc[0] - 1
    sc[0] = n
    if n == 0:
        return
    t, s, k, a, b = ev_t[n], ev_s[n], ev_k[n], ev_a[n], ev_b[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ev_t[c + 1] < ev_t[c] or (ev_t[c + 1] == ev_t[c] and ev_s[c + 1] < ev_s[c])):
            c += 1
        if t < ev_t[c] or (t == ev_t[c] and s < ev_s[c]):
            break
        ev_t[i], ev_s[i], ev_k[i], ev_a[i], ev_b[i] = ev_t[c], ev_s[c], ev_k[c], ev_a[c], ev_b[c]
        i = c
    ev_t[i], ev_s[i], ev_k[i], ev_a[i], ev_b[i] = t, s, k, a, b


@njit(cache=True)
def _hpush(ph_t: Any, ph_r: Any, off: int, n: int, t: float, r: int) -> None:
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if ph_t[off + p] < t or (ph_t[off + p] == t and ph_r[off + p] < r):
            break
        ph_t[off + i], ph_r[off + i] = ph_t[off + p], ph_r[off + p]
        i = p
    ph_t[off + i], ph_r[off + i] = t, r


@njit(cache=True)
def _hpop(ph_t: Any, ph_r: Any, off: int, n: int) -> None:
    """Remove the root of a heap of `n` entries (read it before)."""
    n -= 1
    if n == 0:
        return
    t, r = ph_t[off + n], ph_r[off + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ph_t[off + c + 1] < ph_t[off + c]
                          or (ph_t[off + c + 1] == ph_t[off + c] and ph_r[off + c + 1] < ph_r[off + c])):
            c += 1
        if t < ph_t[off + c] or (t == ph_t[off + c] and r < ph_r[off + c]):
            break
        ph_t[off + i], ph_r[off + i] = ph_t[off + c], ph_r[off + c]
        i = c
    ph_t[off + i], ph_r[off + i] = t, r


# --- strides: `Stride.pick` and `Stride.pick_among` on the shared table --------------------------------------
@njit(cache=True)
def _pick(s: int, st_off: Any, st_len: Any, st_step: Any, st_p: Any) -> int:
    o, n = st_off[s], st_len[s]
    if n == 1:
        return 0
    best = 0
    for i in range(1, n):
        if st_p[o + i] < st_p[o + best]:
            best = i
    st_p[o + best] += st_step[o + best]
    return best


@njit(cache=True)
def _lor(s: int, st_off: Any, st_len: Any, st_item: Any, st_w: Any, outstanding: Any) -> int:
    """`Engine.pick` with router "lor": fewest outstanding per unit of weight."""
    o = st_off[s]
    best, score = 0, np.inf
    for i in range(st_len[s]):
        w = st_w[o + i]
        x = (outstanding[st_item[o + i]] + 1) / w if w > 0 else np.inf
        if x < score:
            best, score = i, x
    return best


@njit(cache=True)
def _decode_step(table: Any, off: int, k: int, ctx: float, grid: Any) -> float:
    g_n = len(grid)
    if ctx <= 1.0:
        return table[off + k * g_n]
    g = min(int(2.0 * np.log2(ctx)), g_n - 2)
    lo, hi = grid[g], grid[g + 1]
    base = off + k * g_n + g
    a = table[base]
    return a + (table[base + 1] - a) * (ctx - lo) / (hi - lo)


@njit(cache=True)
def _cycle(pa_noff: Any, pa_ns: Any, pa_nodes: Any, path: int, dn_dt: Any, dn_k: Any) -> float:
    o, s = pa_noff[path], pa_ns[path]
    if s == 1:
        return dn_dt[pa_nodes[o]]
    total = slowest = 0.0
    in_flight = s
    for j in range(s):
        n = pa_nodes[o + j]
        total += dn_dt[n]
        slowest = dn_dt[n] if dn_dt[n] > slowest else slowest
        in_flight = dn_k[n] if dn_k[n] < in_flight else in_flight
    return max(total, in_flight * slowest)


@njit(cache=True)
def _pick_among(s: int, st_off: Any, st_len: Any, st_step: Any, st_p: Any, room: Any, base: int) -> int:
    """`Stride.pick_among` the node pickers' items i with room[base + i]; -1 when none has."""
    o, n = st_off[s], st_len[s]
    best = -1
    for i in range(n):
        if room[base + i] and (best < 0 or st_p[o + i] < st_p[o + best]):
            best = i
    if best >= 0 and n > 1:
        st_p[o + best] += st_step[o + best]
    return best


@njit(cache=True, inline="always")
def _start_prefill(node: int, t: float, PN: Any, IT: Any, EV: Any) -> None:
    """`take_chunks` then one step: queued prompt tokens FCFS up to the node's batch cap, the last one split."""
    pn_toff, pn_cap, pn_table, _pn_last, _pn_stage, _pn_inst, _pn_lpn, pn_busy, pn_busy_time, pn_q, pn_b = PN
    it_req, it_tok, it_next = IT
    sc, ev_t, ev_s, ev_k, ev_a, ev_b = EV
    cap = pn_cap[node]
    tokens = 0
    b_head = b_tail = -1
    while pn_q[node, 0] >= 0 and tokens < cap:
        item = pn_q[node, 0]
        take = cap - tokens
        if it_tok[item] <= take:
            tokens += it_tok[item]
            pn_q[node, 0] = it_next[item]
            if pn_q[node, 0] < 0:
                pn_q[node, 1] = -1
            got = item
        else:
            it_tok[item] -= take
            got = sc[2]  # a new item from the free list
            if got < 0:
                sc[6] = 1
                return
            sc[2] = it_next[got]
            it_req[got], it_tok[got] = it_req[item], take
            tokens = cap
        it_next[got] = -1
        if b_tail < 0:
            b_head = got
        else:
            it_next[b_tail] = got
        b_tail = got
    dt = pn_table[pn_toff[node] + tokens]
    pn_busy[node] = 1
    pn_b[node, 0], pn_b[node, 1] = b_head, b_tail
    pn_busy_time[node] += dt
    _push(ev_t, ev_s, ev_k, ev_a, ev_b, sc, t + dt, 0, node, 0)


@njit(cache=True, inline="always")
def _change(path: int, delta: int, ctx: float, t: float, DN: Any, PA: Any, EV: Any, grid: Any) -> None:
    """`Engine._change`: one sequence more (+1) or fewer (-1) on every node of `path`, clocks kept consistent."""
    (dn_toff, dn_table, _dn_cap, _dn_kvcap, _dn_lpn, dn_poff, dn_pn, dn_paths, _dn_kvfree, _dn_slots, dn_k, dn_ctx,
         dn_dt, dn_tmark, dn_karea, dn_busy, _room) = DN
    (_path_of, pa_noff, pa_ns, pa_nodes, _pa_inst, pa_prog, pa_tlast, pa_rate, pa_ver, pa_hoff, pa_hn, pa_mark, ph_t,
         _ph_r, touched) = PA
    sc, ev_t, ev_s, ev_k, ev_a, ev_b = EV
    sc[7] += 1
    stamp = sc[7]
    n_touched = 0
    o = pa_noff[path]
    for j in range(pa_ns[path]):
        n = pa_nodes[o + j]
        for q in range(dn_pn[n]):
            p = dn_paths[dn_poff[n] + q]
            if pa_tlast[p] != t:
                pa_prog[p] += (t - pa_tlast[p]) * pa_rate[p]
                pa_tlast[p] = t
            if pa_mark[p] != stamp:
                pa_mark[p] = stamp
                touched[n_touched] = p
                n_touched += 1
        if dn_k[n]:
            dn_busy[n] += t - dn_tmark[n]
            dn_karea[n] += dn_k[n] * (t - dn_tmark[n])
        dn_tmark[n] = t
        k = dn_k[n] + delta
        dn_k[n] = k
        dn_ctx[n] = dn_ctx[n] + delta * ctx if k else 0.0
        dn_dt[n] = _decode_step(dn_table, dn_toff[n], k, dn_ctx[n] / k if k else 1.0, grid)
    for i in range(n_touched):
        p = touched[i]
        pa_rate[p] = 1.0 / _cycle(pa_noff, pa_ns, pa_nodes, p, dn_dt, dn_k)
        pa_ver[p] += 1
        if pa_hn[p]:
            _push(ev_t, ev_s, ev_k, ev_a, ev_b, sc, t + (ph_t[pa_hoff[p]] - pa_prog[p]) / pa_rate[p], 2, p,
                  pa_ver[p])


@njit(cache=True, inline="always")
def _admit(inst: int, t: float, INST: Any, ST: Any, DN: Any, PA: Any, PN: Any, RQ: Any, EV: Any) -> None:
    """`Engine.admit`: waiting requests FIFO while the head finds, on every stage, a node with a free batch slot
    and KV room (`Instance.path_with_room`); its path is made on first use."""
    inst_soff, inst_ns, inst_pbase, stage_noff, stage_nlen, stage_picker, stage_mult, _outstanding, w_q = INST
    st_off, st_len, _st_item, st_step, _st_w, st_p = ST
    (_dn_toff, _dn_table, dn_cap, dn_kvcap, dn_lpn, dn_poff, dn_pn, dn_paths, dn_kvfree, dn_slots, dn_k, _dn_ctx,
         dn_dt, _dn_tmark, _dn_karea, _dn_busy, room) = DN
    (path_of, pa_noff, pa_ns, pa_nodes, pa_inst, pa_prog, pa_tlast, pa_rate, pa_ver, pa_hoff, pa_hn, _pa_mark, ph_t,
         _ph_r, _touched) = PA
    _pn_toff, _pn_cap, _pn_table, _pn_last, _pn_stage, _pn_inst, pn_lpn, _pn_busy, _pn_busy_time, _pn_q, _pn_b = PN
    (_arr, _inp, _out, kv_in, kv_res, _d_ctx, _route_p, _route_d, req_pnode, _p_left, _p_inst, _d_inst, d_path, _t_first,
         _t_done, t_admit, _done_count, w_next) = RQ
    sc, ev_t, ev_s, ev_k, ev_a, ev_b = EV
    so, ns = inst_soff[inst], inst_ns[inst]
    while w_q[inst, 0] >= 0:
        r = w_q[inst, 0]
        need = kv_res[r]
        for j in range(ns):
            base = stage_noff[so + j]
            some = False
            for i in range(stage_nlen[so + j]):
                n = base + i
                ok = dn_slots[n] < dn_cap[n] and dn_kvfree[n] >= min(need, dn_kvcap[n])
                room[n] = ok
                some = some or ok
            if not some:
                return
        key = 0
        for j in range(ns):
            i = _pick_among(stage_picker[so + j], st_off, st_len, st_step, st_p, room, stage_noff[so + j])
            key += i * stage_mult[so + j]
        path = path_of[inst_pbase[inst] + key]
        if path < 0:  # a new path: its nodes, its finishing-target storage, a place in each node's list
            path = sc[5]
            sc[5] = path + 1
            path_of[inst_pbase[inst] + key] = path
            o = sc[8]
            pa_noff[path], pa_ns[path], pa_inst[path] = o, ns, inst
            smallest = 1 << 62
            for j in range(ns):
                n = stage_noff[so + j] + (key // stage_mult[so + j]) % stage_nlen[so + j]
                pa_nodes[o + j] = n
                smallest = min(smallest, dn_cap[n])
                dn_paths[dn_poff[n] + dn_pn[n]] = path
                dn_pn[n] += 1
            sc[8] = o + ns
            pa_hoff[path] = sc[4]
            if sc[4] + smallest + 1 > len(ph_t):
                sc[6] = 1
                return
            sc[4] += smallest + 1
            pa_prog[path], pa_tlast[path], pa_hn[path], pa_ver[path] = 0.0, 0.0, 0, 0
            pa_rate[path] = 1.0 / _cycle(pa_noff, pa_ns, pa_nodes, path, dn_dt, dn_k)
        d_path[r] = path
        w_q[inst, 0] = w_next[r]
        if w_q[inst, 0] < 0:
            w_q[inst, 1] = -1
        t_admit[r] = t
        busiest = 0.0
        for j in range(req_pnode.shape[1]):
            pn = req_pnode[r, j]
            if pn >= 0 and pn_lpn[pn] > busiest:
                busiest = pn_lpn[pn]
        o = pa_noff[path]
        for j in range(ns):
            n = pa_nodes[o + j]
            dn_slots[n] += 1
            dn_kvfree[n] -= min(need, dn_kvcap[n])
            if dn_lpn[n] > busiest:
                busiest = dn_lpn[n]
        _push(ev_t, ev_s, ev_k, ev_a, ev_b, sc, t + kv_in[r] * busiest, 1, r, 0)


@njit(cache=True)
def _loop(lor: bool, horizon: float, grid: Any, EV: Any, ST: Any, INST: Any, PN: Any, IT: Any, DN: Any, PA: Any,
          RQ: Any) -> float:
    """Serve every request; returns the time the loop stopped."""
    sc, ev_t, ev_s, ev_k, ev_a, ev_b = EV
    st_off, st_len, st_item, st_step, st_w, st_p = ST
    inst_soff, inst_ns, _inst_pbase, stage_noff, _stage_nlen, stage_picker, _stage_mult, outstanding, w_q = INST
    _pn_toff, _pn_cap, _pn_table, pn_last, pn_stage, pn_inst, _pn_lpn, pn_busy, _pn_busy_time, pn_q, pn_b = PN
    it_req, it_tok, it_next = IT
    (_dn_toff, _dn_table, _dn_cap, dn_kvcap, _dn_lpn, _dn_poff, _dn_pn, _dn_paths, dn_kvfree, dn_slots, _dn_k, _dn_ctx,
         _dn_dt, _dn_tmark, _dn_karea, _dn_busy, _room) = DN
    (_path_of, pa_noff, pa_ns, pa_nodes, pa_inst, pa_prog, pa_tlast, pa_rate, pa_ver, pa_hoff, pa_hn, _pa_mark, ph_t,
         ph_r, _touched) = PA
    (arr, inp, out, _kv_in, kv_res, d_ctx, route_p, route_d, req_pnode, p_left, p_inst, d_inst, d_path, t_first,
         t_done, _t_admit, done_count, w_next) = RQ
    n = len(arr)
    ai = 0
    t = 0.0
    while True:
        if sc[6]:
            return t
        if ai < n and (sc[0] == 0 or arr[ai] <= ev_t[0]):  # an arrival: `Engine.route_prefill`
            r = ai
            t = arr[r]
            ai += 1
            s = route_p[r]
            if s < 0:
                continue  # no prefill instance of its model: never served (the backlog of a plan that stays)
            o = st_off[s]
            k = st_item[o + (_lor(s, st_off, st_len, st_item, st_w, outstanding) if lor
                             else _pick(s, st_off, st_len, st_step, st_p))]
            outstanding[k] += 1
            p_inst[r] = k
            so = inst_soff[k]
            for j in range(inst_ns[k]):
                req_pnode[r, j] = stage_noff[so + j] + _pick(stage_picker[so + j], st_off, st_len, st_step, st_p)
            p_left[r] = inp[r]
            node = req_pnode[r, 0]
            item = sc[2]
            if item < 0:
                sc[6] = 1
                continue
            sc[2] = it_next[item]
            it_req[item], it_tok[item], it_next[item] = r, inp[r], -1
            if pn_q[node, 1] < 0:
                pn_q[node, 0] = item
            else:
                it_next[pn_q[node, 1]] = item
            pn_q[node, 1] = item
            if not pn_busy[node]:
                _start_prefill(node, t, PN, IT, EV)
            continue
        if sc[0] == 0:
            break
        t, kind, a, b = ev_t[0], ev_k[0], ev_a[0], ev_b[0]
        _pop(ev_t, ev_s, ev_k, ev_a, ev_b, sc)
        if t > horizon:
            t = horizon
            break
        if kind == _PATH:  # `Engine.path_event`
            path = a
            if b != pa_ver[path]:
                continue
            pa_prog[path] += (t - pa_tlast[path]) * pa_rate[path]
            pa_tlast[path] = t
            limit = pa_prog[path] + _EPS
            off = pa_hoff[path]
            if pa_hn[path] and ph_t[off] > limit:  # rounding left the head short: look again when it is due
                _push(ev_t, ev_s, ev_k, ev_a, ev_b, sc, t + (ph_t[off] - pa_prog[path]) / pa_rate[path], _PATH,
                      path, pa_ver[path])
                continue
            o = pa_noff[path]
            k = pa_inst[path]
            while pa_hn[path] and ph_t[off] <= limit:
                r = ph_r[off]
                _hpop(ph_t, ph_r, off, pa_hn[path])
                pa_hn[path] -= 1
                need = kv_res[r]
                for j in range(pa_ns[path]):
                    nd = pa_nodes[o + j]
                    dn_slots[nd] -= 1
                    dn_kvfree[nd] += min(need, dn_kvcap[nd])
                _change(path, -1, d_ctx[r], t, DN, PA, EV, grid)
                t_done[r] = t
                done_count[r] += 1
                outstanding[k] -= 1
            if w_q[k, 0] >= 0:
                _admit(k, t, INST, ST, DN, PA, PN, RQ, EV)
        elif kind == _PREFILL:  # `Engine.prefill_step_done`
            node = a
            pn_busy[node] = 0
            item = pn_b[node, 0]
            if pn_last[node]:
                while item >= 0:
                    r = it_req[item]
                    left = p_left[r] - it_tok[item]
                    p_left[r] = left
                    nxt = it_next[item]
                    it_next[item] = sc[2]  # back to the free list
                    sc[2] = item
                    item = nxt
                    if left != 0:
                        continue
                    t_first[r] = t
                    outstanding[pn_inst[node]] -= 1
                    if out[r] <= 1:
                        t_done[r] = t
                        done_count[r] += 1
                        continue
                    s = route_d[r]  # `Engine.route_decode`
                    if s < 0:
                        continue
                    o = st_off[s]
                    k = st_item[o + (_lor(s, st_off, st_len, st_item, st_w, outstanding) if lor
                                     else _pick(s, st_off, st_len, st_step, st_p))]
                    outstanding[k] += 1
                    d_inst[r] = k
                    w_next[r] = -1
                    if w_q[k, 1] < 0:
                        w_q[k, 0] = r
                    else:
                        w_next[w_q[k, 1]] = r
                    w_q[k, 1] = r
                    if w_q[k, 0] == r:
                        _admit(k, t, INST, ST, DN, PA, PN, RQ, EV)
            else:
                stage = pn_stage[node] + 1
                while item >= 0:
                    nxt_item = it_next[item]
                    r = it_req[item]
                    nxt = req_pnode[r, stage]
                    tail = pn_q[nxt, 1]
                    if tail >= 0 and it_req[tail] == r:
                        it_tok[tail] += it_tok[item]
                        it_next[item] = sc[2]
                        sc[2] = item
                    else:
                        it_next[item] = -1
                        if tail < 0:
                            pn_q[nxt, 0] = item
                        else:
                            it_next[tail] = item
                        pn_q[nxt, 1] = item
                    if not pn_busy[nxt]:
                        _start_prefill(nxt, t, PN, IT, EV)
                    item = nxt_item
            pn_b[node, 0] = pn_b[node, 1] = -1
            if pn_q[node, 0] >= 0:
                _start_prefill(node, t, PN, IT, EV)
        else:  # _KV, `Engine.kv_done`
            r = a
            path = d_path[r]
            if pa_tlast[path] != t:
                pa_prog[path] += (t - pa_tlast[path]) * pa_rate[path]
                pa_tlast[path] = t
            _hpush(ph_t, ph_r, pa_hoff[path], pa_hn[path], pa_prog[path] + out[r] - 1, r)
            pa_hn[path] += 1
            _change(path, 1, d_ctx[r], t, DN, PA, EV, grid)
    return t


def serve(engine: Engine, duration_s: float, pool: int | None = None) -> tuple[Trace, Record]:
    """Run `engine` (its initial plan applied, every instance ready) to its horizon in the compiled loop and
    write what it records back into the engine's lists and its instances' nodes, as the Python loop leaves them.
    `pool`: the pools' first size (default: the requests + 1024; tests start them tiny to make them grow)."""
    lay = flatten(engine)
    i, f = lay.ints, lay.floats
    n, n_p, n_d, n_i = engine.n, len(lay.pnodes), len(lay.dnodes), len(lay.insts)
    max_ns = max([len(x.stages) for x in lay.insts], default=1)
    paths = max(int(i["path_slots"][0]), 1)
    through = max(int(i["dn_pcap"].sum()), 1)  # paths through each decode node, all nodes together
    events = items = pool or n + 1024
    finishing = pool or int(i["dn_cap"].sum()) + paths + 1024

    def i8(size: int | tuple[int, int], fill: int = -1) -> np.ndarray:
        return np.full(size, fill, dtype=_I)

    def f8(size: int, fill: float = 0.0) -> np.ndarray:
        return np.full(size, fill, dtype=np.float64)

    while True:
        sc = np.zeros(9, dtype=_I)  # heap size, pushes, free chunk, -, finishing used, paths, overflow, stamp, nodes
        ev = (sc, f8(events), i8(events, 0), i8(events, 0), i8(events, 0), i8(events, 0))
        st = (i["st_off"], i["st_len"], i["st_item"], f["st_step"], f["st_w"], f["st_step"].copy())
        inst = (i["inst_soff"], i["inst_ns"], i["inst_pbase"], i["stage_noff"], i["stage_nlen"], i["stage_picker"],
                i["stage_mult"], i8(n_i, 0), i8((n_i, 2)))
        pn = (i["pn_toff"], i["pn_cap"], f["pn_table"], i["pn_last"], i["pn_stage"], i["pn_inst"], f["pn_lpn"],
              i8(n_p, 0), f8(n_p), i8((n_p, 2)), i8((n_p, 2)))
        it_next = np.arange(1, items + 1, dtype=_I)
        it_next[-1] = -1
        it = (i8(items, 0), i8(items, 0), it_next)
        dn = (i["dn_toff"], f["dn_table"], i["dn_cap"], f["dn_kvcap"], f["dn_lpn"], i["dn_poff"], i8(n_d, 0),
              i8(through), f["dn_kvcap"].copy(), i8(n_d, 0), i8(n_d, 0), f8(n_d),
              np.array([x.dt for x in lay.dnodes], dtype=np.float64), f8(n_d), f8(n_d), f8(n_d),
              np.zeros(n_d, dtype=np.bool_))
        pa = (i8(paths), i8(paths, 0), i8(paths, 0), i8(paths * max_ns, 0), i8(paths, 0), f8(paths), f8(paths),
              f8(paths), i8(paths, 0), i8(paths, 0), i8(paths, 0), i8(paths), f8(finishing), i8(finishing, 0),
              i8(paths, 0))
        rq = (f["arr"], i["inp"], i["out"], f["kv_in"], f["kv_res"], f["d_ctx"], i["route_p"], i["route_d"],
              i8((n, max_ns)), i8(n, 0), i8(n), i8(n), i8(n), f8(n, np.nan), f8(n, np.nan), f8(n, np.nan),
              i8(n, 0), i8(n))
        t = _loop(engine.router == "lor", engine.horizon, f["grid"], ev, st, inst, pn, it, dn, pa, rq)
        if not sc[6]:
            break
        events, items, finishing = 2 * events, 2 * items, 2 * finishing  # a pool ran out: again, all doubled
    return _write_back(engine, lay, inst, pn, dn, rq, t, duration_s)


def _write_back(engine: Engine, lay: Layout, inst: tuple[Any, ...], pn: tuple[Any, ...], dn: tuple[Any, ...],
                rq: tuple[Any, ...], t: float, duration_s: float) -> tuple[Trace, Record]:
    outstanding, pn_busy_time = inst[7], pn[8]
    dn_kvfree, dn_slots, dn_k, dn_ctx, dn_dt, dn_tmark, dn_karea, dn_busy = dn[8:16]
    p_inst, d_inst, _, t_first, t_done, t_admit, done_count = rq[10:17]
    end = max(t, duration_s)
    live = dn_k > 0  # `Engine.stop` at the end: decode nodes integrate their batch up to it
    dn_busy[live] += end - dn_tmark[live]
    dn_karea[live] += dn_k[live] * (end - dn_tmark[live])
    dn_tmark[live] = end
    for i, node in enumerate(lay.pnodes):
        node.busy_time = float(pn_busy_time[i])
    for i, d in enumerate(lay.dnodes):
        d.busy_time, d.k_area, d.t_mark = float(dn_busy[i]), float(dn_karea[i]), float(dn_tmark[i])
        d.k, d.slots, d.kv_free = int(dn_k[i]), int(dn_slots[i]), float(dn_kvfree[i])
        d.ctx_sum, d.dt = float(dn_ctx[i]), float(dn_dt[i])
    for i, x in enumerate(lay.insts):
        x.outstanding = int(outstanding[i])
    for x in engine.trace.instances:
        if x.state != STOPPED:
            x.state, x.stop_s = STOPPED, end
    at = {id(x): k for k, x in enumerate(engine.trace.instances)}
    where = np.array([at[id(x)] for x in lay.insts] + [-1], dtype=_I)  # layout index -> trace index; -1: none
    engine.trace.end_s = end
    return engine.trace, Record(first_token_s=t_first, decode_admit_s=t_admit, done_s=t_done, done_count=done_count,
                                refused=np.zeros(engine.n, dtype=bool), prefill_instance=where[p_inst],
                                decode_instance=where[d_inst])
