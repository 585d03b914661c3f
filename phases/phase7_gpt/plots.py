"""Phase 7's plots, one PNG per GPU from its newest record: the overfitting curves, the scaling law
with its fits, and the failure runs' loss and gradient norm. matplotlib is imported only when a
plot is drawn, so `lab report --check` does without it."""
from common.plotting import pyplot, save


def _record(view, exercise: str, hw: str) -> dict:
    rows = view.latest(exercise, measured_only=True)
    return view.record(rows[rows["hardware"] == hw].iloc[0]["path"])


def _ok(rec: dict) -> list[dict]:
    return [r for r in rec["rows"] if r["status"] == "ok"]


def _name(rec: dict) -> str:
    return (rec["hardware"].get("spec") or {}).get("name") or rec["hardware"]["key"]



def overfit(view, hw: str, path) -> None:
    plt, rec = pyplot(), _record(view, "phase7.overfit", hw)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for variant, color in (("large", "tab:red"), ("small", "tab:blue")):
        r = next((r for r in _ok(rec) if r["variant"] == variant), None)
        if r is None:
            continue
        c = [p for p in r["metrics"]["curve"] if p[1] is not None and p[2] is not None]
        label = f"{r['metrics']['params_total'] / 1e6:.2f}M params"
        ax.plot([p[0] for p in c], [p[1] for p in c], "--", color=color, label=f"{label}: train")
        ax.plot([p[0] for p in c], [p[2] for p in c], "-", color=color, label=f"{label}: validation")
        if r["metrics"]["best_val_step"] is not None:
            ax.scatter([r["metrics"]["best_val_step"]], [r["metrics"]["best_val_loss"]], color=color, zorder=3)
    last = max((p[0] for r in _ok(rec) for p in r["metrics"]["curve"]), default=0)
    seed = [p for p in (rec.get("summary", {}).get("seed") or {}).get("overfit_30m") or [] if p[0] <= last]
    if seed:
        ax.scatter([p[0] for p in seed], [p[1] for p in seed], marker="x", color="black", label="seed's 30M (A100): train")
        ax.scatter([p[0] for p in seed], [p[2] for p in seed], marker="+", s=60, color="black",
                   label="seed's 30M (A100): validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats)")
    ax.set_title(f"Overfitting TinyShakespeare: {_name(rec)}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


def scaling(view, hw: str, path) -> None:
    from matplotlib.ticker import FormatStrFormatter
    plt, rec = pyplot(), _record(view, "phase7.scaling", hw)
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ok = [r for r in _ok(rec) if r["metrics"].get("best_val_loss") is not None]
    s = rec.get("summary", {})
    for key, fitkey, color, label in (("n_non_embedding", "fit_non_embedding", "tab:blue", "non-embedding N"),
                                      ("n_total", "fit_total", "tab:orange", "total N")):
        xs = [r["metrics"][key] for r in ok]
        ys = [r["metrics"]["best_val_loss"] for r in ok]
        ax.scatter(xs, ys, color=color, zorder=3, label=f"best val loss vs {label}")
        for r, x, y in zip(ok, xs, ys):
            ax.annotate(r["variant"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        f = s.get(fitkey)
        if f and xs:
            lo, hi = min(xs) / 1.5, max(xs) * 1.5
            grid = [lo * (hi / lo) ** (i / 50) for i in range(51)]
            bs = f["bootstrap"]
            ci = f" [{bs['low']:.3f}, {bs['high']:.3f}]" if bs.get("low") is not None else ""
            ax.plot(grid, [f["a"] * x ** -f["alpha"] for x in grid], "-", color=color, alpha=0.6,
                    label=f"fit: {f['a']:.2f} N^-{f['alpha']:.4f}{ci}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    ax.set_xlabel("parameters N")
    ax.set_ylabel("best validation loss")
    tokens = ok[0]["metrics"].get("unique_train_tokens") if ok else None
    ax.set_title(f"Scaling on a fixed {tokens / 1e3:.0f}K-token dataset: {_name(rec)}" if tokens
                 else f"Scaling on a fixed dataset: {_name(rec)}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save(fig, path)


def failures(view, hw: str, path) -> None:
    plt, rec = pyplot(), _record(view, "phase7.failures", hw)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in _ok(rec):
        style = "-" if r["variant"] == "control" else "--" if r["variant"].startswith("no_") else ":"
        loss = [p for p in r["metrics"]["train_loss_per_step"] if p[1] is not None]
        gn = [p for p in r["metrics"]["grad_norm_per_step"] if p[1] is not None and p[1] > 0]
        a1.plot([p[0] for p in loss], [p[1] for p in loss], style, lw=1, label=r["variant"])
        if gn:
            a2.plot([p[0] for p in gn], [p[1] for p in gn], style, lw=1, label=r["variant"])
    a1.set_xlabel("step")
    a1.set_ylabel("training loss (batch)")
    a1.set_title(f"Engineered failures: loss ({_name(rec)})")
    a2.set_yscale("log")
    a2.set_xlabel("step")
    a2.set_ylabel("gradient norm (before clipping; zeros not drawn)")
    a2.set_title("gradient norm, every step")
    for a in (a1, a2):
        a.grid(True, which="both", alpha=0.3)
    a1.legend(fontsize=7)
    save(fig, path)
