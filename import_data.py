"""Import your own logged data into the dataset format every algorithm script reads (docs/import.md).

    python import_data.py --logs examples/logs_example.csv --env-id CartPole-v1 --dataset-path datasets/mine.npz
    python import_data.py --minari-id cartpole/random-v0 --dataset-path datasets/cartpole_random.npz
    python brpo.py --env-id CartPole-v1 --dataset-path datasets/mine.npz

Logs are an .npz, .csv or .parquet file of transitions in the order they were logged, episode after episode:
observations (`obs_0`, `obs_1`, ... columns; an `observations` array in an .npz), `action` (integer), `reward`,
`terminal`, and `timeout` or `episode_end` (the episode ended without a terminal state); optionally `next_obs_*`
(otherwise the next row's observation inside an episode), and the behaviour policy's probabilities: `prob_0`,
`prob_1`, ... for every action, or `propensity`, the probability of the logged action. A Minari dataset is read by
its id from the local Minari data directory (`pip install -e ".[import]"`).

BRPO needs beta(.|s) at every logged state and, for evaluation and the improvement certificate, at any state. Where
the logs carry it, it is used as logged; in every case a behaviour-cloning network is fitted on the logs (FC(32)-
FC(16), early-stopped on held-out episodes), its temperature calibrated on half of the held-out episodes, and its
fit reported on the other half (log-likelihood per transition against the uniform policy, expected calibration
error). It is stored with the dataset as beta(a|s) = floor + (1 - |A| floor) softmax(f(s) / temperature), so that no
action has probability 0. A fit significantly worse than the uniform policy is refused.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import math
import os
import re
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":  # an interrupt while the libraries below load has nothing to clean up: one line, exit 130
    signal.signal(signal.SIGINT, lambda *_: (print(f"{Path(sys.argv[0]).name}: interrupted; nothing written",
                                                   file=sys.stderr), os._exit(130)))
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import common
from common import fail, require

MAX_ACTIONS = 1000  # the dataset stores beta(.|s) for every action of every transition (N x |A| numbers, twice)


@dataclass
class Args:
    logs: Optional[str] = None
    """logged transitions: an .npz, .csv or .parquet file (columns: module docstring, docs/import.md)"""
    minari_id: Optional[str] = None
    """a Minari dataset id in the local Minari data directory (instead of --logs)"""
    env_id: Optional[str] = None
    """the task the logs come from (required with --logs; default with --minari-id: the dataset's); if it is not an
    installed gymnasium task, the scripts train without a simulator and the improvement certificate is the score"""
    n_actions: Optional[int] = None
    """action count of a task that is not installed here (default: the prob_* columns, else the largest action + 1)"""
    dataset_path: Optional[str] = None
    """output .npz; default datasets/<logs file name or Minari id>.npz"""
    overwrite: bool = False
    """replace an existing dataset at --dataset-path"""
    seed: int = 0
    """seed of the held-out split and of the behaviour model's fit"""
    holdout: float = 0.2
    """share of the episodes held out from the behaviour model's training (calibration and the fit report)"""
    behavior_floor: float = 1e-3
    """smallest probability the behaviour model may give an action (the floor itself is fitted, at least this)"""
    fit_steps: int = 20_000
    """most Adam updates of the behaviour model (lr 3e-3, batch 1024; stopped when the held-out fit stalls)"""


# ---- reading logs: every source becomes the same columns
def read_table(path: Path) -> dict:
    """Columns of a .csv (header row) or .parquet file as float64 arrays (actions stay exact: float64 holds every
    integer up to 2^53)."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ModuleNotFoundError:
            fail("reading .parquet needs pyarrow: pip install -e \".[import]\"")
        try:
            table = pq.read_table(path)
        except Exception as e:
            fail(f"logs {path} are unreadable as parquet ({type(e).__name__}: {' '.join(str(e).split())})")
        cols = {}
        for name in read_names(table.column_names, path, table=True):
            col = table.column(name).to_numpy(zero_copy_only=False)
            if col.dtype.kind not in "biuf":
                fail(f"logs {path}: column {name!r} is not numeric ({col.dtype})")
            cols[name] = col.astype(np.float64)
        return cols
    csv.field_size_limit(2**31 - 1)  # csv's limit is 128 KB a field: a column the importer ignores may be longer
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark is not a name
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        fail(f"logs {path} are unreadable ({type(e).__name__}: {e})")
    if len(rows) < 2:
        fail(f"logs {path} hold no transitions (a header row and one row per transition are expected)")
    header, body = [name.strip() for name in rows[0]], rows[1:]
    twice = sorted({name for name in header if header.count(name) > 1})
    require(not twice, f"logs {path}: columns {twice} appear more than once in the header")
    if any(len(r) != len(header) for r in body):
        line = next(i for i, r in enumerate(body) if len(r) != len(header)) + 2
        fail(f"logs {path}: line {line} has a different number of columns than the header ({len(header)})")
    read = read_names(header, path, table=True)
    columns = [header.index(name) for name in read]  # only these are converted: a timestamp column is no number
    try:
        values = np.array([[r[i] for i in columns] for r in body], dtype=np.float64)
    except ValueError as e:
        fail(f"logs {path} hold a value that is not a number ({e})")
    return {name: values[:, i] for i, name in enumerate(read)}


def columns_to_arrays(cols: dict, path: Path) -> dict:
    """Stack obs_i / next_obs_i / prob_i columns into arrays named as in an .npz of logs."""
    out = {}
    for prefix, key in (("obs_", "observations"), ("next_obs_", "next_observations"), ("prob_", "behavior_probs")):
        names = sorted((c for c in cols if c.startswith(prefix) and c[len(prefix):].isdigit()),
                       key=lambda c: int(c[len(prefix):]))
        if names and [int(c[len(prefix):]) for c in names] != list(range(len(names))):
            fail(f"logs {path}: columns {names} are not numbered {prefix}0 .. {prefix}{len(names) - 1}")
        if names:
            out[key] = np.stack([cols[c] for c in names], 1)
    renames = {"action": "actions", "reward": "rewards", "terminal": "terminals", "timeout": "timeouts",
               "episode_end": "episode_ends", "propensity": "propensities"}
    out.update({renames[c]: v for c, v in cols.items() if c in renames})
    return out


# the names read: the columns of a .csv / .parquet (and obs_<i>, next_obs_<i>, prob_<i>), the arrays of an .npz
TABLE_NAMES = ("action", "reward", "terminal", "timeout", "episode_end", "propensity")
NPZ_NAMES = ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts", "episode_ends",
             "propensities", "behavior_probs")
NUMBERED = re.compile(r"(obs|next_obs|prob)_\d+")
ALTERNATIVES = (("timeout", "episode_end", "timeouts", "episode_ends"),  # names that supply the same data
                ("propensity", "propensities", "behavior_probs", "prob_"))


def read_names(names, path: Path, table: bool) -> list:
    """The names the importer reads. One it does not read but that resembles a name whose data the logs lack (a
    misspelt 'propensity' in logs without probabilities) is refused: that data would be dropped unseen. Any other (a
    timestamp, an episode id) is ignored, and said so."""
    known = TABLE_NAMES if table else NPZ_NAMES
    read = [n for n in names if n in known or (table and NUMBERED.fullmatch(n))]
    unknown = [n for n in names if n not in read]
    base = lambda n: "prob_" if n.startswith("prob_") else n  # noqa: E731
    supplied = {base(n) for n in read}
    supplied |= {a for group in ALTERNATIVES if supplied & set(group) for a in group}
    for n in unknown if table or "format_version" not in names else ():  # a dataset's own arrays are no typos
        digits = re.search(r"\d*$", n).group() or "0"
        numbered = (f"{p}_{digits}" for p in ("obs", "next_obs", "prob")) if table else ()
        like = difflib.get_close_matches(n, (*known, *numbered), 1, 0.8)
        if like and base(like[0]) not in supplied:
            fail(f"logs {path}: {'column' if table else 'array'} {n!r} is not one the importer reads, and "
                 f"{like[0]!r}, which it resembles, is missing: if it holds that, rename it (docs/import.md lists the "
                 "names); if not, drop it")
    if unknown:
        print(f"logs {path}: ignoring {'columns' if table else 'arrays'} {unknown} (not read by the importer)")
    return read


def read_logs(path: Path) -> dict:
    if not path.exists():
        fail(f"logs {path} not found")
    if common.not_a_file(path):
        fail(f"logs {path} are unreadable ({common.NOT_A_FILE})")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as f:
                return {k: f[k] for k in read_names(f.files, path, table=False)}
        except Exception as e:
            fail(f"logs {path} are unreadable ({common.npz_error(path, e)})")
    if path.suffix in (".csv", ".parquet"):
        return columns_to_arrays(read_table(path), path)
    fail(f"logs {path}: unknown file type {path.suffix!r}; pass an .npz, .csv or .parquet file")


def read_minari(dataset_id: str) -> tuple[dict, str]:
    try:
        import minari
    except ModuleNotFoundError:
        fail("reading Minari datasets needs minari: pip install -e \".[import]\"")
    try:
        dataset = minari.load_dataset(dataset_id)
    except Exception as e:
        fail(f"cannot load Minari dataset {dataset_id!r} from the local data directory ({' '.join(str(e).split())}); "
             "download it first with: minari download " + dataset_id)
    if not isinstance(dataset.action_space, common.gym.spaces.Discrete):
        fail(f"Minari dataset {dataset_id} has {dataset.action_space} actions; only discrete actions are supported")
    if not isinstance(dataset.observation_space, common.gym.spaces.Box) or len(dataset.observation_space.shape) != 1:
        fail(f"Minari dataset {dataset_id} has {dataset.observation_space} observations; only vectors are supported")
    parts = {k: [] for k in ("observations", "next_observations", "actions", "rewards", "terminals", "timeouts")}
    for ep in dataset.iterate_episodes():
        parts["observations"].append(ep.observations[:-1])
        parts["next_observations"].append(ep.observations[1:])
        parts["actions"].append(ep.actions)
        parts["rewards"].append(ep.rewards)
        parts["terminals"].append(ep.terminations)
        parts["timeouts"].append(ep.truncations & ~ep.terminations)
    if not parts["actions"]:
        fail(f"Minari dataset {dataset_id} holds no episodes")
    env_id = dataset.env_spec.id if dataset.env_spec is not None else None
    return {k: np.concatenate(v) for k, v in parts.items()}, env_id


def validate(logs: dict, source: str, n_actions: int, obs_dim: int) -> dict:
    """The transitions as the dataset stores them, or one line saying what is wrong with the logs."""
    required = ("observations", "actions", "rewards", "terminals")
    missing = [k for k in required if k not in logs]
    if "timeouts" not in logs and "episode_ends" not in logs:
        missing.append("timeouts or episode_ends")
    require(not missing, f"logs {source} lack {missing} (docs/import.md lists the columns)")
    for k, v in logs.items():
        require(np.asarray(v).dtype.kind in "biuf", f"logs {source}: {k} holds {np.asarray(v).dtype} values, not numbers")
    obs = np.asarray(logs["observations"])
    require(obs.ndim == 2 and obs.shape[0] > 0, f"logs {source}: observations have shape {obs.shape}, expected "
            "(transitions, observation size)")
    n = obs.shape[0]
    lengths = {k: len(np.asarray(v)) for k, v in logs.items() if np.asarray(v).ndim >= 1}
    wrong = {k: m for k, m in lengths.items() if m != n}
    require(not wrong, f"logs {source}: columns have different lengths ({n} observations, but {wrong})")
    require(obs.shape[1] == obs_dim, f"logs {source}: observations have {obs.shape[1]} values, the task's have {obs_dim}")
    for k in [k for k in ("rewards", "terminals", "timeouts", "episode_ends", "propensities") if k in logs]:
        require(np.ndim(logs[k]) == 1, f"logs {source}: {k} have shape {np.shape(logs[k])}, expected ({n},): one value "
                "per transition")
    for k in [k for k in ("observations", "next_observations", "rewards") if k in logs]:  # in float64: a cast to
        x = np.asarray(logs[k], np.float64)  # float32 would warn, then say inf
        require(np.isfinite(x).all(), f"logs {source}: {k} contain NaN or inf")
        require((np.abs(x) <= np.finfo(np.float32).max).all(), f"logs {source}: {k} hold values beyond float32's "
                "range (3.4e38); rescale them")
    a = np.asarray(logs["actions"])
    require(a.ndim == 1, f"logs {source}: actions have shape {a.shape}; only one discrete action per transition is "
            "supported (continuous actions are not)")
    require(a.dtype.kind in "iub" or (a.dtype.kind == "f" and np.all(np.isfinite(a)) and np.all(a == np.round(a))),
            f"logs {source}: actions are not integers (continuous actions are not supported)")
    require(a.min() >= 0 and a.max() < n_actions, f"logs {source}: actions outside the action space [0, {n_actions})")
    a = a.astype(np.int64)
    out = {"observations": obs.astype(np.float32), "actions": a, "rewards": np.asarray(logs["rewards"], np.float32)}
    for k in ("terminals", "timeouts", "episode_ends"):
        if k in logs:
            x = np.asarray(logs[k])
            require(x.dtype.kind == "b" or np.isin(x, (0, 1)).all(), f"logs {source}: {k} must be 0/1 or booleans")
            out[k] = x.astype(bool)
    ends = out["episode_ends"] | out["terminals"] if "episode_ends" in out else out["terminals"] | out["timeouts"]
    out["timeouts"] = ends & ~out["terminals"]
    out.pop("episode_ends", None)
    require(ends[-1], f"logs {source}: the last episode has no end (its last transition is not terminal, timeout or "
            "episode_end); drop the unfinished episode or mark where it ended")
    if "next_observations" in logs:
        nxt = np.asarray(logs["next_observations"])
        require(nxt.shape == obs.shape, f"logs {source}: next observations have shape {nxt.shape}, not {obs.shape}")
        out["next_observations"] = nxt.astype(np.float32)
    else:  # inside an episode, the next row; an episode's last transition keeps its own state (docs/import.md)
        nxt = np.concatenate([obs[1:], obs[-1:]]).astype(np.float32)
        out["next_observations"] = np.where(ends[:, None], obs.astype(np.float32), nxt)
    if "propensities" in logs:
        prop = np.asarray(logs["propensities"], np.float64)
        require(np.isfinite(prop).all() and (prop > 0).all() and (prop <= 1).all(),
                f"logs {source}: propensities must lie in (0, 1]")
    if "behavior_probs" in logs:
        p = np.asarray(logs["behavior_probs"], np.float64)
        require(p.shape == (n, n_actions), f"logs {source}: behaviour probabilities have shape {p.shape}, expected "
                f"({n}, {n_actions}) (one per action)")
        require(np.isfinite(p).all() and (p >= 0).all() and np.allclose(p.sum(1), 1.0, atol=1e-4),
                f"logs {source}: behaviour probabilities are not distributions (each row non-negative, summing to 1)")
        require((p[np.arange(n), a] > 0).all(), f"logs {source}: a logged action has behaviour probability 0")
        out["behavior_probs"] = p / p.sum(1, keepdims=True)
        if "propensities" in logs:  # both: they must say the same (up to rounding to two decimals), or which one
            gap = np.abs(out["behavior_probs"][np.arange(n), a] - prop)  # is the behaviour policy is a guess
            require(not (gap > 0.01).any(), f"logs {source}: the behaviour probabilities and the propensities "
                    f"disagree at {int((gap > 0.01).sum())} transitions (by up to {gap.max():.3g}); keep only one")
    elif "propensities" in logs:
        out["propensities"] = prop
    return out


# ---- the behaviour model
class BehaviorNetwork(nn.Module):
    """FC(32)-FC(16) action logits, the layout of the behaviour networks in every dataset (docs/formats.md)."""

    def __init__(self, obs_dim: int, n_actions: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, n_actions))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def floored(logits: torch.Tensor, temperature: float, floor: float) -> torch.Tensor:
    return floor + (1.0 - logits.shape[1] * floor) * torch.softmax(logits / temperature, 1)


def nll(logits: torch.Tensor, actions: torch.Tensor, temperature: float, floor: float) -> torch.Tensor:
    """Per-transition negative log-likelihood of the logged actions."""
    return -torch.log(floored(logits, temperature, floor).gather(1, actions[:, None]).squeeze(1))


def fit_behavior(d: dict, n_actions: int, args: Args) -> tuple[BehaviorNetwork, float, dict]:
    """Behaviour cloning on the training episodes, early-stopped on the calibration half of the held-out ones;
    temperature fitted on that half; fit reported on the other half."""
    episode = np.concatenate([[0], np.cumsum((d["terminals"] | d["timeouts"])[:-1])])
    n_episodes = int(episode[-1]) + 1
    require(n_episodes >= 3, f"the logs hold {n_episodes} episode(s); fitting and checking a behaviour model needs at "
            "least 3 (1 to fit, 2 held out)")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(n_episodes)
    n_held = min(max(2, round(args.holdout * n_episodes)), n_episodes - 1)
    calibrate, report = order[:n_held:2], order[1:n_held:2]
    part = {"train": ~np.isin(episode, order[:n_held]), "calibrate": np.isin(episode, calibrate),
            "report": np.isin(episode, report)}
    obs = torch.from_numpy(d["observations"])
    actions = torch.from_numpy(d["actions"])
    torch.manual_seed(args.seed)
    net = BehaviorNetwork(obs.shape[1], n_actions)
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    train_idx = torch.from_numpy(np.flatnonzero(part["train"]))
    cal = torch.from_numpy(part["calibrate"])
    generator = torch.Generator().manual_seed(args.seed)
    best, best_state, best_step = math.inf, None, 0
    for step in range(1, args.fit_steps + 1):
        idx = train_idx[torch.randint(len(train_idx), (1024,), generator=generator)]
        loss = F.cross_entropy(net(obs[idx]), actions[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 500 == 0 or step == args.fit_steps:
            with torch.no_grad():
                held = float(F.cross_entropy(net(obs[cal]), actions[cal]))
            if held < best:
                best, best_state, best_step = held, {k: v.clone() for k, v in net.state_dict().items()}, step
            elif step - best_step >= 5_000:
                break  # no better fit of the calibration episodes in 5,000 updates
    require(best_state is not None, "the behaviour model's held-out loss is not finite: are the observations finite "
            "and of a moderate scale?")
    net.load_state_dict(best_state)
    with torch.no_grad():
        logits = net(obs).double()
    # calibration on the calibration episodes (maximum likelihood): a temperature T and a floor, i.e. the weight of
    # a uniform mixture, so that actions the network calls impossible keep the probability the held-out logs show
    # them to have (for epsilon-greedy logs the floor recovers eps / |A|); --behavior-floor is the smallest floor
    best = (math.inf, 1.0, args.behavior_floor)
    top = max(args.behavior_floor, 0.5 / n_actions)  # 0.5 / |A|: an even mix of the network and the uniform policy
    for floor in np.geomspace(args.behavior_floor, top, 24) if args.behavior_floor > 0 else [0.0]:
        lo, hi, g = math.log(0.05), math.log(20.0), (math.sqrt(5) - 1) / 2  # golden section over log T
        f = lambda t: float(nll(logits[cal], actions[cal], math.exp(t), float(floor)).mean())  # noqa: E731
        for _ in range(40):
            x1, x2 = hi - g * (hi - lo), lo + g * (hi - lo)
            lo, hi = (lo, x2) if f(x1) <= f(x2) else (x1, hi)
        best = min(best, (f((lo + hi) / 2), math.exp((lo + hi) / 2), float(floor)))
    _, temperature, floor = best
    rep = torch.from_numpy(part["report"])
    per = nll(logits[rep], actions[rep], temperature, floor).numpy()
    uniform = math.log(n_actions)
    probs = floored(logits[rep], temperature, floor).numpy()
    ece = expected_calibration_error(probs, d["actions"][part["report"]])
    diff_se = float(per.std(ddof=1) / math.sqrt(len(per))) if len(per) > 1 else 0.0
    fit = {"episodes": {"train": int(n_episodes - n_held), "calibrate": len(calibrate), "report": len(report)},
           "heldout_log_likelihood": float(-per.mean()), "uniform_log_likelihood": -uniform,
           "heldout_log_likelihood_se": diff_se, "expected_calibration_error": ece, "temperature": temperature,
           "floor": floor}
    require(per.mean() - uniform <= 2 * diff_se,
            f"the behaviour model fits the held-out episodes worse than the uniform policy (log-likelihood per "
            f"transition {-per.mean():.4f} against {-uniform:.4f}); provide more episodes"
            + ("" if "behavior_probs" in d or "propensities" in d else ", or log the behaviour probabilities (prob_* "
               "columns or propensity)"))
    return net, (temperature, floor), fit


def expected_calibration_error(probs: np.ndarray, actions: np.ndarray, bins: int = 10) -> float:
    """Mean |confidence - accuracy| of the most likely action over 10 confidence bins, weighted by bin size."""
    conf, hit = probs.max(1), probs.argmax(1) == actions
    which = np.minimum((conf * bins).astype(int), bins - 1)
    return float(sum(abs(conf[which == b].mean() - hit[which == b].mean()) * (which == b).mean()
                     for b in range(bins) if (which == b).any()))


def behavior_arrays(d: dict, net: BehaviorNetwork, temperature: float, floor: float, n_actions: int) -> dict:
    """beta(.|s) and beta(.|s') of every transition: logged where the logs carry it, the model elsewhere."""
    with torch.no_grad():
        model = floored(net(torch.from_numpy(d["observations"])).double(), temperature, floor).numpy()
        model_next = floored(net(torch.from_numpy(d["next_observations"])).double(), temperature, floor).numpy()
    n, rows, a = len(d["actions"]), np.arange(len(d["actions"])), d["actions"]
    if "behavior_probs" in d:
        beta = d["behavior_probs"]
    elif "propensities" in d:  # the logged action's probability as logged, the rest of the mass as the model splits it
        p, others = d["propensities"], 1.0 - model[rows, a]
        beta = np.where(others[:, None] > 1e-12, model * ((1.0 - p) / np.maximum(others, 1e-12))[:, None],
                        (1.0 - p)[:, None] / max(n_actions - 1, 1))
        beta[rows, a] = p
    else:
        beta = model
    ends = d["terminals"] | d["timeouts"]
    same = np.zeros(n, dtype=bool)  # s' is the next row's state: its (possibly logged) beta
    same[:-1] = ~ends[:-1] & np.all(d["next_observations"][:-1] == d["observations"][1:], axis=1)
    next_beta = np.where(same[:, None], np.concatenate([beta[1:], beta[-1:]]), model_next)
    return {"behavior_probs": beta.astype(np.float32), "next_behavior_probs": next_beta.astype(np.float32)}


def main(args: Args) -> None:
    require((args.logs is None) != (args.minari_id is None), "pass exactly one of --logs and --minari-id")
    require(0.0 < args.holdout < 1.0, f"--holdout must lie in (0, 1), got {args.holdout}")
    require(args.fit_steps > 0, f"--fit-steps must be positive, got {args.fit_steps}")
    require(0 <= args.seed < 2**32, f"--seed must lie in [0, 2**32), got {args.seed}")
    if args.logs:
        require(args.env_id, "pass --env-id: the task the logs come from (a gymnasium id evaluates in its simulator)")
        logs, env_id, source = read_logs(Path(args.logs)), args.env_id, args.logs
        name = Path(args.logs).stem
    else:
        logs, env_id, source = *read_minari(args.minari_id), f"Minari dataset {args.minari_id}"
        env_id = args.env_id or env_id
        require(env_id, f"Minari dataset {args.minari_id} names no environment; pass --env-id")
        name = args.minari_id.replace("/", "_")
    require(0.0 <= args.behavior_floor < 0.5, f"--behavior-floor must lie in [0, 0.5), got {args.behavior_floor}")
    if common.has_simulator(env_id):
        env = common.make_env(env_id)
        obs_dim, n_actions = env.observation_space.shape[0], int(env.action_space.n)
        require(args.n_actions in (None, n_actions), f"--n-actions {args.n_actions}: {env_id} has {n_actions} actions")
    else:  # sizes from the logs; the scripts will score by the certificate (docs/import.md)
        obs, a = np.asarray(logs.get("observations", np.zeros((0, 0)))), np.asarray(logs.get("actions", np.zeros(0)))
        probs = np.asarray(logs.get("behavior_probs", np.zeros((0, 2))))
        require(obs.ndim == 2 and a.ndim == 1 and len(a) > 0 and probs.ndim == 2, f"logs {source} lack observations "
                "(N, size) or actions (N,), or their behavior_probs are not (N, actions)")
        wrong = [f"{k} ({x.dtype})" for k, x in (("observations", obs), ("actions", a), ("behavior_probs", probs))
                 if x.dtype.kind not in "biuf"]
        require(not wrong, f"logs {source}: {', '.join(wrong)} must hold real numbers")
        require(np.isfinite(a).all(), f"logs {source}: actions contain NaN or inf")
        obs_dim = obs.shape[1]
        n_actions = args.n_actions if args.n_actions is not None else (probs.shape[1] if "behavior_probs" in logs
                                                                       else int(a.max()) + 1)
        supported = f"at least 2 and at most {MAX_ACTIONS} are supported"
        require(2 <= n_actions <= MAX_ACTIONS, f"--n-actions {n_actions}: {supported}" if args.n_actions is not None
                else f"logs {source} show {n_actions:.3g} action(s); {supported} (pass --n-actions if the logs do not "
                "show every action)")
        print(f"{env_id} is not an installed gymnasium task: the scripts will train on this dataset without a simulator, "
              "scored by the improvement certificate", flush=True)
    require(args.behavior_floor * n_actions < 1.0, f"--behavior-floor {args.behavior_floor} leaves no mass for "
            f"{n_actions} actions")
    path = Path(args.dataset_path) if args.dataset_path else common.REPO / "datasets" / f"{name}.npz"
    require(args.overwrite or not path.exists(), f"{path} exists; pass --overwrite to replace it, or another "
            "--dataset-path")
    d = validate(logs, source, n_actions, obs_dim)
    torch.set_num_threads(1)
    net, (temperature, floor), fit = fit_behavior(d, n_actions, args)
    d.update(behavior_arrays(d, net, temperature, floor, n_actions))
    episode = np.concatenate([[0], np.cumsum((d["terminals"] | d["timeouts"])[:-1])])
    returns = np.bincount(episode, weights=d["rewards"].astype(np.float64))
    logged = "logged probabilities" if "behavior_probs" in logs else "logged propensities" if "propensities" in d \
        else "estimated"
    d.pop("propensities", None)
    weights = {f"behavior_{k}": v.numpy().astype(np.float32) for k, v in zip(common.BEHAVIOR_KEYS, net.state_dict().values())}
    settings = {"source": source, "behavior_probs": logged, "fit": fit, **asdict(args)}
    buffer = io.BytesIO()
    np.savez(buffer, **d, **weights, epsilon=np.float64(np.nan), env_id=np.array(env_id),
             behavior_return=np.float64(returns.mean()), behavior_return_std=np.float64(returns.std()),
             format_version=np.int64(common.FORMAT_VERSION), settings_json=np.array(json.dumps(settings)),
             behavior_kind=np.array("softmax"), behavior_temperature=np.float64(temperature),
             behavior_floor=np.float64(floor))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        common.write_atomic(path, buffer.getvalue())
    except OSError as e:
        fail(f"cannot write {path} ({e.strerror or e}); pass a writable --dataset-path")
    print(f"behaviour model: held-out log-likelihood {fit['heldout_log_likelihood']:.4f} +- "
          f"{fit['heldout_log_likelihood_se']:.4f} per transition (uniform policy {-math.log(n_actions):.4f}), "
          f"calibration error {fit['expected_calibration_error']:.3f}, temperature {temperature:.3g}, floor {floor:.3g} "
          f"({fit['episodes']['report']} report episodes)")
    print(f"wrote {path}: {len(d['actions'])} transitions, {len(returns)} episodes of {env_id}, behaviour "
          f"probabilities {logged}, logged return {returns.mean():.1f} +- {returns.std():.1f}")


if __name__ == "__main__":
    common.cli(Args, main)
