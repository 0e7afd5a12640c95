"""Render a simulation report (the dict ``conformance.simulator.simulate.simulate`` returns) as text or HTML.

``render_text`` is the terminal summary; ``render_html`` one self-contained
page (inline CSS, no script, no external asset, every value HTML-escaped)
showing each run like a trace view: the task, a timeline of tool calls and
live trace events with their sources and ledger changes, the agent's
transcript and its final response.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from . import gate

__all__ = ["progress_line", "render_text", "render_html", "write_reports", "write_file", "render_comparison_text",
           "render_comparison_html"]

# "ran": the run ended without error and its response is valid.  It is no verdict on the expected outcome.
_STATUS_WORD = {"ok": "ran", "error": "ERROR", "invalid": "INVALID"}


def _short(text: Any, limit: int = 100) -> str:
    """One line of at most ``limit`` characters (JSON for non-strings)."""
    if not isinstance(text, str):
        text = json.dumps(text, ensure_ascii=False, default=str)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _where(run: Mapping[str, Any], trials: int = 1) -> str:
    """``row 3 (line 4)``, and ``trial 2/3`` after it when rows run more than one trial."""
    where = f"row {run['row']}" + (f" (line {run['line']})" if run.get("line") is not None else "")
    return where + (f" trial {run.get('trial', 1)}/{trials}" if trials > 1 else "")


def _source_label(call: Mapping[str, Any]) -> str:
    """``odyssey`` / ``injected by rule N`` / ``error``, or the HTTP status of a rejected request."""
    if call.get("source") == "injected":
        label = f"injected by rule {call.get('matched_rule_index')}"
    elif call.get("source") is None:
        label = f"rejected, HTTP {call.get('http_status')}"
    else:
        label = str(call.get("source"))
    if call.get("answered_by") == "model":
        label += ", by the model"
    return label + (" (replayed)" if call.get("replayed") else "")


# ---------------------------------------------------------------------------
# Text
# ---------------------------------------------------------------------------


def progress_line(run: Mapping[str, Any], trials: int = 1) -> str:
    """One line for a finished run (of ``trials`` per row), for stderr while the simulation goes on."""
    where = _where(run, trials)
    if run["status"] == "invalid":
        return f"{where}: not run, the dataset check rejected it ({_plural(len(run['errors']), 'error')})"
    calls = run["tool_calls"]
    injected = sum(1 for c in calls if c.get("source") == "injected" and not c.get("replayed"))
    head = (f"{where}: {_STATUS_WORD[run['status']]}, {_plural(len(calls), 'tool call')}, {injected} injected, "
            f"{run.get('duration_ms', 0):.0f} ms")
    if "judge" in run:
        head += f", {verdict_text(run['judge'], 120)}"
    if run["errors"]:
        head += f": {_short(run['errors'][0], 160)}"
    return head


def verdict_text(judge: Mapping[str, Any], limit: int = 300) -> str:
    """``PASS 5/5: ...``, ``FAIL 2/5 incorrect_completion, instruction adherence 3/5: ...`` or ``not judged:
    reason``, on one line."""
    if judge.get("verdict") not in ("PASS", "FAIL"):
        return f"not judged: {_short(judge.get('error') or 'no verdict', limit)}"
    mode = f" {judge['failure_mode']}" if judge.get("failure_mode") else ""
    adherence = (f", instruction adherence {judge['instruction_adherence']}/5"
                 if judge.get("instruction_adherence") is not None else "")
    cached = " (cached)" if judge.get("cached") else ""
    return (f"{judge['verdict']} {judge.get('task_completion')}/5{mode}{adherence}{cached}: "
            f"{_short(judge.get('explanation') or '', limit)}")


def render_text(result: Mapping[str, Any]) -> str:
    """The terminal report: per row the instruction, calls, errors and final response; a summary last."""
    agent = result.get("agent") or {}
    trials = gate.trials_of(result)
    lines = [f"simulation of {result['dataset']['file']}" + (f" against {agent.get('mode')} agent {agent.get('target')}"
                                                               if agent else "")]
    for run in result["runs"]:
        lines.append("")
        lines.append(f"{_where(run, trials)}  {_STATUS_WORD[run['status']]}  "
                     f"{_short(run.get('user_instruction', ''), 80)}")
        if run["status"] == "invalid":
            lines += [f"    dataset error: {e}" for e in run["errors"]]
            if "judge" in run:
                lines.append(f"    judge: {verdict_text(run['judge'])}")
            continue
        outcome = run["expected_outcome"] + ("" if run.get("expected_outcome_given") else " (default)")
        lines.append(f"    expected outcome: {outcome}: {outcome_word(run)}")
        if "judge" in run:
            lines.append(f"    judge: {verdict_text(run['judge'])}")
            for cut in run["judge"].get("cuts") or []:
                lines.append(f"        shown cut: {cut}")
        for flag in (run.get("outcome") or {}).get("flags") or []:
            lines.append(f"    FLAGGED: {flag}")
        for attempt in (run.get("outcome") or {}).get("attempted") or []:
            lines.append(f"    note: {attempt}")
        if run.get("behavior_instructions"):
            how = "given to the simulator's model" if result.get("simulator") else "not enforced"
            lines.append(f"    behavior ({how}): {_short(run['behavior_instructions'], 100)}")
        for rule in run["failure_rules"]:
            lines.append(f"    rule {rule['index']}: {rule['summary']}  [fired {rule['fired']}x]")
        lines += _conversation_text(run)
        for call in run["tool_calls"]:
            answer = f": {_short(call.get('response'), 80)}" if call.get("source") is not None else ""
            lines.append(f"    #{call['index']} {call['tool_name']} {_short(call.get('arguments'), 60)} -> "
                         f"{_source_label(call)}{answer}")
            for change in call.get("changes") or []:
                lines.append(f"        ledger: {_change_text(change)}")
        for event in run["trace_events"]:
            lines.append(f"    trace {event['event_type']}: {_short(event.get('payload'), 80)}")
        for note in run.get("notes") or []:
            lines.append(f"    note: {note}")
        for warning in run["warnings"]:
            lines.append(f"    warning: {warning}")
        for error in run["errors"]:
            lines.append(f"    error: {_short(error, 300)}")
        if run.get("final_response") is not None:
            lines.append(f"    final response: {_short(run['final_response'], 200)}")
    s = result["summary"]
    if trials > 1 and s.get("judge"):
        lines += ["", *trials_text(result["runs"], trials)]
    lines.append("")
    over = f" ({_plural(len(gate.row_verdicts(result['runs'])), 'row')}, {trials} trials each)" if trials > 1 else ""
    lines.append(f"{_plural(s['runs'], 'run')}{over}: {s['ok']} ran without error, {_plural(s['errors'], 'error')}; "
                 f"{_plural(s['tool_calls'], 'tool call')}, {s['injected']} injected")
    if s.get("sessions"):
        turns = _plural(s["sessions"]["turns"], "turn")
        lines.append(f"sessions: {s['sessions']['runs']} model_as_user row(s), {turns}")
    for role, label in (("simulator", "simulated backend"), ("user", "simulated user")):
        spent = (s.get("model_usage") or {}).get(role)
        if spent:
            lines.append(f"{label} usage: {_plural(spent['requests'], 'request')}, {spent['prompt_tokens']:,} prompt + "
                         f"{spent['completion_tokens']:,} completion tokens, {spent['cached']} answered from the cache")
    for server in result.get("model_servers") or []:  # the run's, not the rows': a merge of shards has none
        lines.append(server_text(server))
    verdicts = s.get("judge")
    if verdicts:
        lines.append(judge_summary_text(verdicts, (result.get("judge") or {}).get("model"), trials))
    else:
        lines.append(f"expected outcomes: not judged (no --judge); {s.get('flagged', 0)} refusal row(s) flagged "
                     "for an action carried out")
    return "\n".join(lines)


def _conversation_text(run: Mapping[str, Any]) -> List[str]:
    """A session's turns: what the user said, what the agent answered, the calls it made meanwhile."""
    session = run.get("session")
    if not session:
        return []
    lines = [(f"    session {session.get('session_id')}: {_plural(session.get('turns', 0), 'turn')}, "
              f"ended: {session.get('ended')}")]
    turns = run.get("conversation") or []
    for turn in turns:
        calls = ", ".join(f"#{i}" for i in turn.get("tool_calls") or [])
        lines.append(f"    turn {turn.get('turn')} user: {_short(turn.get('user') or '', 100)}")
        agent = f"(failed: {_short(turn['error'], 90)})" if turn.get("error") else _short(turn.get("agent") or "", 100)
        done = "" if turn.get("error") else f" [{session_done_text(turn.get('session_done'), turn is not turns[-1])}]"
        lines.append(f"           agent: {agent}{done}" + (f"  [calls {calls}]" if calls else ""))
    return lines


def trials_text(runs: List[Mapping[str, Any]], trials: int) -> List[str]:
    """Each row over its trials: its passes out of K, FLAKY when its verdicts are mixed, each trial's verdict."""
    lines = [f"rows over {trials} trials:"]
    for row in gate.row_verdicts(runs, trials):
        said = ", ".join(gate.verdict_word(run) for run in row.runs)
        flaky = "  FLAKY" if row.flaky else ""
        lines.append(f"  {_where(row.runs[0])}  {row.score} passed{flaky}  [{said}]  "
                     f"{_short(row.runs[0].get('user_instruction', ''), 60)}")
    return lines


def session_done_text(hint: Any, went_on: bool = False) -> str:
    """A turn's ``session_done`` as the reports show it: the agent's hint (``went_on``: a later turn followed, so
    the user did not take it), or that its reply gave none."""
    if hint is None:
        return "no session_done (a response envelope)"
    return f"session_done: {'true' if hint else 'false'}" + (", the user went on" if hint and went_on else "")


def judge_summary_text(verdicts: Mapping[str, Any], model: Optional[str], trials: int = 1) -> str:
    """The judge's summary: the pass rate (and pass^k, pass@k), verdict counts, failure modes, requests, tokens."""
    modes = ", ".join(f"{mode} {count}" for mode, count in (verdicts.get("failure_modes") or {}).items())
    usage = verdicts.get("usage") or {}
    over_trials = ""
    if trials > 1 and "pass_hat_k" in verdicts:
        over_trials = (f"\nover {trials} trials: pass^{trials} {verdicts['pass_hat_k']:.1%} (rows that passed every "
                       f"trial), pass@{trials} {verdicts['pass_at_k']:.1%} (rows that passed at least once), "
                       f"{verdicts.get('flaky', 0)} flaky row(s)")
    adherence = verdicts.get("instruction_adherence")
    return (f"judge{f' ({model})' if model else ''}: pass rate {verdicts['pass_rate']:.1%}: {verdicts['pass']} PASS, "
            f"{verdicts['fail']} FAIL, {verdicts['not_judged']} not judged"
            + (f"; failure modes: {modes}" if modes else "")
            + (f"; instruction adherence {adherence['mean']:.2f}/5 on average over {_plural(adherence['runs'], 'run')} "
               "with behavior" if adherence else "") + over_trials
            + f"\njudge usage: {_plural(usage.get('requests', 0), 'request')}, "
              f"{usage.get('prompt_tokens', 0):,} prompt + {usage.get('completion_tokens', 0):,} completion tokens, "
              f"{usage.get('cached', 0)} answered from the cache")


def server_text(server: Mapping[str, Any]) -> str:
    """One model server's line: who asked it, how many requests it took, at most and typically at once."""
    slowed = server.get("slowed_down") or 0
    return (f"model server {server.get('server')} ({', '.join(server.get('roles') or [])}): "
            f"{_plural(server.get('requests') or 0, 'request')}, at most {server.get('max_at_once')} at once, "
            f"typically {server.get('typical_at_once')} (bound {server.get('bound')})"
            + (f"; slowed down {_plural(slowed, 'time')} (a timeout, 429 or 503, or requests queueing there)"
               if slowed else ""))


def outcome_word(run: Mapping[str, Any]) -> str:
    """How the expected outcome stands: the judge's verdict, else flagged or not judged."""
    judge = run.get("judge") or {}
    if judge.get("verdict") in ("PASS", "FAIL"):
        return f"judged {judge['verdict']}"
    check = run.get("outcome") or {}
    return "FLAGGED (see below)" if check.get("flags") else "not judged"


def _change_text(change: Mapping[str, Any]) -> str:
    op = change.get("op")
    if op == "set_flag":
        return f"set_flag {change.get('flag')}"
    entity = f"{change.get('entity_type')} {change.get('entity_id')}"
    if op == "update":
        before, after = change.get("before") or {}, change.get("after") or {}
        diffs = [f"{k}: {_short(before.get(k), 30)} -> {_short(after.get(k), 30)}"
                 for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k)]
        return f"update {entity}: " + ("; ".join(diffs) or "no change")
    if op == "add":
        return f"add {entity} {_short(change.get('after'), 60)}"
    return f"{op} {entity}"


# ---------------------------------------------------------------------------
# HTML
# ---------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;background:#f5f6f8;color:#1d2330}
header{background:#1d2330;color:#fff;padding:16px 24px}header h1{margin:0 0 4px;font-size:20px}
header .meta{color:#b8c0d0;font-size:13px}main{padding:16px 24px;max-width:1200px}
.summary{display:flex;gap:8px;flex-wrap:wrap;margin:8px 0 0}.pill{border-radius:10px;padding:1px 9px;font-size:12px;
font-weight:600;background:#e3e7ee;color:#1d2330;white-space:nowrap}.ok{background:#d7f2df;color:#135c2b}
.error,.invalid{background:#fbdcdc;color:#8a1c1c}.injected{background:#ffe7c2;color:#7a4300}
.odyssey{background:#dde9ff;color:#17407f}.src-error{background:#fbdcdc;color:#8a1c1c}
details.run{background:#fff;border:1px solid #dde1e8;border-radius:8px;margin:12px 0}
details.run>summary{cursor:pointer;padding:10px 14px;display:flex;gap:10px;align-items:center}
details.run>summary .instr{flex:1;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.body{padding:0 14px 14px}
h3{font-size:13px;text-transform:uppercase;letter-spacing:.04em;color:#5a6478;margin:16px 0 6px}
.task{display:grid;grid-template-columns:max-content 1fr;gap:4px 12px}.task dt{color:#5a6478}.task dd{margin:0}
pre{background:#f3f4f7;border-radius:6px;padding:8px;margin:4px 0;white-space:pre-wrap;word-break:break-word;
font:12px/1.4 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;max-height:360px;overflow:auto}
.step{border-left:3px solid #c9d0dc;padding:4px 0 4px 12px;margin:8px 0}.step.inj{border-color:#f0a030}
.step.err{border-color:#d04545}.step.evt{border-color:#9a7fd1}.step .head{display:flex;gap:8px;align-items:center;
flex-wrap:wrap}.t{color:#5a6478;font-size:12px;min-width:70px}.name{font-weight:600;font-family:ui-monospace,monospace}
.cols{display:grid;grid-template-columns:1fr 1fr;gap:8px}.lbl{font-size:11px;color:#5a6478}
table.diff{border-collapse:collapse;font-size:12px;margin:4px 0}table.diff td{border:1px solid #e1e4ea;padding:2px 6px}
.before{color:#8a1c1c;text-decoration:line-through}.after{color:#135c2b}
.msg{border:1px solid #e1e4ea;border-radius:6px;padding:6px 10px;margin:6px 0}.role{font-size:11px;font-weight:700;
text-transform:uppercase;color:#5a6478}.final{border:2px solid #7aa2e3;border-radius:8px;padding:8px 12px;
white-space:pre-wrap;word-break:break-word;background:#fbfcff}.errors{background:#fdf0f0;border:1px solid #f2c4c4;
border-radius:6px;padding:6px 12px}.warnings{background:#fff8ec;border:1px solid #f3ddb4;border-radius:6px;
padding:6px 12px}.muted{color:#5a6478}ul{margin:4px 0;padding-left:20px}
.flagged{background:#f9d0f0;color:#7a1465}.toolbar{display:flex;gap:8px;flex-wrap:wrap;align-items:center;
margin:12px 0}.toolbar input{flex:1;min-width:200px;padding:5px 8px;border:1px solid #c9d0dc;border-radius:6px}
.toolbar button,.toolbar select{padding:4px 10px;border:1px solid #c9d0dc;border-radius:6px;background:#fff}
.turn{font-size:12px;color:#5a6478}.said{white-space:pre-wrap}
.flaky{background:#e6dcfa;color:#4a2590}
table.trials{border-collapse:collapse;margin:8px 0 16px;background:#fff;font-size:13px}
table.trials th,table.trials td{border:1px solid #dde1e8;padding:4px 8px;text-align:left;vertical-align:top}
table.trials th{color:#5a6478;font-weight:600}table.trials a{text-decoration:none}
table.trials td:first-child,table.trials td:nth-child(2){white-space:nowrap}
.pass{background:#d7f2df;color:#135c2b}.fail{background:#fbdcdc;color:#8a1c1c}.not-judged{background:#eee3c6;color:#5c4a12}
.body.judged{display:grid;grid-template-columns:minmax(0,1fr) 300px;gap:16px;align-items:start}
.verdict{position:sticky;top:8px;border:1px solid #dde1e8;border-radius:8px;padding:8px 12px;margin-top:16px;
background:#fbfcff}.verdict .big{font-size:18px;font-weight:700}.verdict p{margin:6px 0;white-space:pre-wrap}
@media (max-width:900px){.body.judged{grid-template-columns:1fr}.verdict{position:static}}
"""

# The page works without JavaScript (every run listed, <details> open and close natively); with it, a
# toolbar filters and searches.  The state can come from the URL fragment too (#status=error&q=refund&open=all),
# so a headless browser can check it without clicking.
_SCRIPT = """
(function(){
var runs=[].slice.call(document.querySelectorAll('details.run'));
var bar=document.getElementById('toolbar');bar.hidden=false;
var q=document.getElementById('q'),st=document.getElementById('status'),shown=document.getElementById('shown');
function apply(){var text=q.value.trim().toLowerCase(),want=st.value,n=0;
runs.forEach(function(r){var ok=(!want||(' '+r.dataset.tags+' ').indexOf(' '+want+' ')>=0)&&
(!text||r.textContent.toLowerCase().indexOf(text)>=0);r.hidden=!ok;if(ok)n++;});
shown.textContent=n+' of '+runs.length+' shown';}
function all(open){runs.forEach(function(r){if(!r.hidden)r.open=open;});}
document.getElementById('expand').onclick=function(){all(true);};
document.getElementById('collapse').onclick=function(){all(false);};
q.oninput=apply;st.onchange=apply;
var h=new URLSearchParams(location.hash.slice(1));
if(h.get('q'))q.value=h.get('q');if(h.get('status'))st.value=h.get('status');
apply();if(h.get('open')==='all')all(true);if(h.get('open')==='none')all(false);
})();
"""


def _e(value: Any) -> str:
    """HTML-escaped text of any value (JSON for non-strings)."""
    if not isinstance(value, str):
        value = json.dumps(value, ensure_ascii=False, default=str)
    return html.escape(value, quote=True)


def _pre(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, indent=2, default=str)
    return f"<pre>{html.escape(text, quote=True)}</pre>"


def _pill(text: str, css: str = "") -> str:
    return f'<span class="pill {css}">{_e(text)}</span>'


_FILTERS = [("", "every run"), ("error", "errors"), ("injected", "with injected failures"),
            ("refusal", "refusal rows"), ("flagged", "flagged"), ("ran", "ran without error")]
_HONEST = ('<p class="muted">"ran" means the run ended without error and answered validly: it is no verdict. '
           "Expected outcomes are not judged here (no judge); a refusal row whose agent carried out an acting "
           "tool call is flagged.</p>")
_HONEST_JUDGED = ('<p class="muted">"ran" means the run ended without error and answered validly; the verdict '
                  "beside each run is the judge's ({model}), graded by the rubric the report names. A row not "
                  "judged is not a pass.</p>")


def _tag(text: str) -> str:
    """A filter tag: lower-case words joined by hyphens (a failure mode is free text)."""
    return "-".join(re.findall(r"[a-z0-9]+", text.lower())) or "none"


def _toolbar(result: Mapping[str, Any], trials: int) -> str:
    filters = list(_FILTERS)
    verdicts = (result.get("summary") or {}).get("judge")
    if verdicts:
        filters += [("pass", "judged PASS"), ("fail", "judged FAIL"), ("not-judged", "not judged")]
        filters += [("flaky", "flaky rows (mixed verdicts over the trials)")] if trials > 1 else []
        filters += [(f"mode-{_tag(mode)}", f"failure mode: {mode}") for mode in verdicts.get("failure_modes") or {}]
    options = "".join(f'<option value="{_e(value)}">{_e(label)}</option>' for value, label in filters)
    return ('<div class="toolbar" id="toolbar" hidden><button id="expand" type="button">Expand all</button>'
            '<button id="collapse" type="button">Collapse all</button>'
            f'<select id="status" aria-label="filter">{options}</select>'
            '<input id="q" type="search" placeholder="search instructions, calls, answers" aria-label="search">'
            '<span id="shown" class="muted"></span></div>')


def render_html(result: Mapping[str, Any]) -> str:
    """The whole report as one self-contained HTML page."""
    s = result["summary"]
    agent = result.get("agent") or {}
    trials = gate.trials_of(result)
    rows = gate.row_verdicts(result["runs"], trials) if trials > 1 and s.get("judge") else []
    flaky = {row.row for row in rows if row.flaky}
    title = f"Simulation: {result['dataset']['file']}"
    meta = [f"started {result.get('started_at', '')}", f"{result.get('duration_ms', 0):.0f} ms"]
    if agent:
        meta.insert(0, f"{agent.get('mode')} agent {agent.get('target')}")
    if result.get("fixtures"):
        meta.append(f"fixtures {result['fixtures']}")
    if result.get("judge"):
        judge = result["judge"]
        meta.append(f"judge {judge.get('model')} ({judge.get('server')}), rubric {judge.get('prompt')}")
    meta += [server_text(server) for server in result.get("model_servers") or []]
    parts = [
        _head(title),
        f"<header><h1>{_e(title)}</h1><div class=\"meta\">{_e(' · '.join(meta))}</div>",
        '<div class="summary">',
        _pill(_plural(s["runs"], "run")),
        _pill(f"{s['ok']} ran", "ok"),
        _pill(_plural(s["errors"], "error"), "error" if s["errors"] else ""),
        _pill(_plural(s["tool_calls"], "tool call")),
        _pill(f"{s['injected']} injected", "injected" if s["injected"] else ""),
        _pill(f"{s.get('flagged', 0)} flagged", "flagged" if s.get("flagged") else ""),
        *_verdict_pills(s.get("judge"), trials),
        "</div></header><main>",
        _toolbar(result, trials),
        _HONEST_JUDGED.format(model=_e((result.get("judge") or {}).get("model") or "a model")) if s.get("judge")
        else _HONEST,
    ]
    problems = result["dataset"].get("problems") or []
    if problems:
        parts.append("<h3>Dataset check</h3><ul>")
        for p in problems:
            where = ", ".join(x for x in (f"line {p['line']}" if p.get("line") is not None else "",
                                          f"row {p['row']}" if p.get("row") is not None else "",
                                          f"column {p['column']}" if p.get("column") else "") if x)
            parts.append(f"<li>{_pill(p['severity'], 'error' if p['severity'] == 'error' else 'injected')} "
                         f"{_e(where)}{': ' if where else ''}{_e(p['message'])}</li>")
        parts.append("</ul>")
    if rows:
        parts.append(_trials_html(rows))
    for run in result["runs"]:
        try:
            parts.append(_run_html(run, simulated=bool(result.get("simulator")), trials=trials,
                                   flaky=run.get("row") in flaky))
        except Exception:  # noqa: BLE001 - an agent's odd output must never cost the whole report
            parts.append(f'<details class="run" open><summary>{_e(_where(run, trials))}</summary>{_pre(run)}</details>')
    parts.append(f"</main><script>{_SCRIPT}</script></body></html>")
    return "\n".join(parts) + "\n"


def _head(title: str) -> str:
    """A page's start, up to its body: the title and the report's style."""
    return "\n".join(['<!DOCTYPE html>', '<html lang="en"><head><meta charset="utf-8">',
                      '<meta name="viewport" content="width=device-width, initial-scale=1">',
                      f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>"])


def _verdict_pills(verdicts: Optional[Mapping[str, Any]], trials: int = 1) -> List[str]:
    if not verdicts:
        return []
    pills = [_pill(f"pass rate {verdicts['pass_rate']:.1%}"), _pill(f"{verdicts['pass']} PASS", "pass"),
             _pill(f"{verdicts['fail']} FAIL", "fail" if verdicts["fail"] else ""),
             _pill(f"{verdicts['not_judged']} not judged", "not-judged" if verdicts["not_judged"] else "")]
    adherence = verdicts.get("instruction_adherence")
    if adherence:
        pills.append(_pill(f"instruction adherence {adherence['mean']:.2f}/5 ({_plural(adherence['runs'], 'run')})"))
    if trials > 1 and "pass_hat_k" in verdicts:
        pills += [_pill(f"{trials} trials per row"), _pill(f"pass^{trials} {verdicts['pass_hat_k']:.1%}"),
                  _pill(f"pass@{trials} {verdicts['pass_at_k']:.1%}"),
                  _pill(f"{verdicts.get('flaky', 0)} flaky", "flaky" if verdicts.get("flaky") else "")]
    return pills


def _run_anchor(run: Mapping[str, Any]) -> str:
    """A run's id in the page: ``row-3`` for a row's first trial, ``row-3-t2`` for its second."""
    trial = run.get("trial", 1)
    return f"row-{run['row']}" + (f"-t{trial}" if trial != 1 else "")


def _trials_html(rows: List[gate.RowVerdicts]) -> str:
    """Each row over its trials: its passes out of K, flaky or not, each trial's verdict linking to its run."""
    out = [(f'<h3>Rows over {rows[0].trials} trials</h3><table class="trials" id="trials"><tr><th>row</th>'
            "<th>passed</th><th>trials</th><th>user instruction</th></tr>")]
    for row in rows:
        first = row.runs[0]
        links = " ".join(f'<a href="#{_e(_run_anchor(run))}">{_verdict_pill(run.get("judge")) or _pill("not run")}</a>'
                         for run in row.runs)
        css = "pass" if row.passed_all else "flaky" if row.flaky else "fail"
        out.append(f'<tr data-row="{_e(row.row)}"><td><a href="#{_e(_run_anchor(first))}">{_e(_where(first))}</a>'
                   f"</td><td>{_pill(row.score, css)}{' ' + _pill('flaky', 'flaky') if row.flaky else ''}</td>"
                   f"<td>{links}</td><td>{_e(_short(first.get('user_instruction', ''), 100))}</td></tr>")
    out.append("</table>")
    return "".join(out)


def _verdict_tags(judge: Any) -> List[str]:
    if not isinstance(judge, Mapping):
        return []
    if judge.get("verdict") not in ("PASS", "FAIL"):
        return ["not-judged"]
    mode = judge.get("failure_mode")
    return [str(judge["verdict"]).lower()] + ([f"mode-{_tag(str(mode))}"] if mode else [])


def _verdict_pill(judge: Any) -> str:
    if not isinstance(judge, Mapping):
        return ""
    if judge.get("verdict") not in ("PASS", "FAIL"):
        return _pill("not judged", "not-judged")
    return _pill(f"{judge['verdict']} {judge.get('task_completion')}/5", str(judge["verdict"]).lower())


def _verdict_html(judge: Mapping[str, Any], usage: Any) -> str:
    """The judge's panel, beside the trace: the verdict, the score, the failure mode, the explanation."""
    out = ['<aside class="verdict"><h3>Judge</h3>']
    if judge.get("verdict") in ("PASS", "FAIL"):
        out.append(f'<div class="big">{_pill(str(judge["verdict"]), str(judge["verdict"]).lower())} '
                   f'task completion {_e(judge.get("task_completion"))}/5</div>')
        if judge.get("failure_mode"):
            out.append(f'<div>failure mode <b>{_e(judge["failure_mode"])}</b></div>')
        if judge.get("instruction_adherence") is not None:
            out.append(f'<div>instruction adherence <b>{_e(judge["instruction_adherence"])}/5</b> '
                       '<span class="lbl">(the backend\'s rules kept)</span></div>')
        out.append(f'<p>{_e(judge.get("explanation") or "")}</p>')
    else:
        out.append(f'<div class="big">{_pill("not judged", "not-judged")}</div><p>{_e(judge.get("error") or "")}</p>')
    spent = usage.get("judge") if isinstance(usage, Mapping) and isinstance(usage.get("judge"), Mapping) else {}
    facts = [f"model {judge.get('model')}" if judge.get("model") else "",
             "answered from the cache" if judge.get("cached") else
             (f"{spent.get('requests', 0)} request(s), {spent.get('prompt_tokens', 0):,} + "
              f"{spent.get('completion_tokens', 0):,} tokens" if spent else "")]
    out.append(f'<div class="lbl">{_e(" · ".join(f for f in facts if f))}</div>')
    if judge.get("cuts"):
        out.append('<div class="lbl">shown to the judge cut short:</div><ul class="lbl">'
                   + "".join(f"<li>{_e(c)}</li>" for c in judge["cuts"]) + "</ul>")
    out.append("</aside>")
    return "".join(out)


def _run_html(run: Mapping[str, Any], *, simulated: bool = False, trials: int = 1, flaky: bool = False) -> str:
    status = run["status"]
    calls: List[Dict[str, Any]] = run.get("tool_calls") or []
    injected = sum(1 for c in calls if c.get("source") == "injected" and not c.get("replayed"))
    check = run.get("outcome") or {}
    judge = run.get("judge") if isinstance(run.get("judge"), Mapping) else None
    tags = ["ran" if status == "ok" else status] + (["injected"] if injected else []) + (
        ["refusal"] if run.get("expected_outcome") == "refusal" else []) + (
        ["flagged"] if check.get("flags") else []) + _verdict_tags(judge) + (["flaky"] if flaky else [])
    opened = " open" if status != "ok" or check.get("flags") or (judge and judge.get("verdict") != "PASS") else ""
    out = [
        f'<details class="run" id="{_e(_run_anchor(run))}" data-tags="{_e(" ".join(tags))}"{opened}>',
        f"<summary>{_pill(_STATUS_WORD[status], status)} {_verdict_pill(judge)} <b>{_e(_where(run, trials))}</b>",
        f'<span class="instr">{_e(run.get("user_instruction", ""))}</span>',
        _pill(_plural(len(calls), "call")) + (_pill(f"{injected} injected", "injected") if injected else "")
        + (_pill("flagged", "flagged") if check.get("flags") else "") + (_pill("flaky row", "flaky") if flaky else ""),
        "</summary>",
        f'<div class="body{" judged" if judge else ""}">',
    ]
    if judge:  # the trace on the left, the verdict on the right
        out.append("<div>")
    if run.get("errors"):
        out.append('<h3>Errors</h3><div class="errors"><ul>')
        out += [f"<li>{_e(e)}</li>" for e in run["errors"]]
        out.append("</ul></div>")
        if run.get("traceback"):
            out.append(f"<details><summary>traceback</summary>{_pre(run['traceback'])}</details>")
    if status == "invalid":
        out.append(f"<p class=\"muted\">{_e('; '.join(run.get('notes') or []))}</p>")
        out.append(_close_body(run, judge))
        return "\n".join(out)
    out.append(_task_html(run, simulated, trials))
    if check.get("flags") or check.get("attempted"):
        out.append('<h3>Expected outcome</h3><div class="errors"><ul>')
        out += [f"<li><b>flagged:</b> {_e(f)}</li>" for f in check.get("flags") or []]
        out += [f"<li>{_e(a)}</li>" for a in check.get("attempted") or []]
        out.append("</ul></div>")
    if run.get("warnings") or run.get("notes"):
        out.append('<h3>Notes</h3><div class="warnings"><ul>')
        out += [f"<li>{_e(w)}</li>" for w in (run.get("warnings") or []) + (run.get("notes") or [])]
        out.append("</ul></div>")
    if run.get("conversation"):
        out.append(_conversation_html(run))
    out.append("<h3>Timeline</h3>")
    out.append(_timeline_html(run))
    messages = run.get("messages")
    if messages:
        out.append("<h3>Transcript</h3>")
        if isinstance(messages, list):
            out += [_message_html(m) for m in messages]
        else:  # not a transcript at all (the run's errors say so): shown as it came
            out.append(f'<div class="msg">{_pre(messages)}</div>')
    out.append("<h3>Final response</h3>")
    if run.get("final_response") is not None:
        out.append(f'<div class="final">{_e(run["final_response"])}</div>')
    else:
        out.append('<p class="muted">(none)</p>')
    if run.get("metadata"):
        out.append(f"<details><summary>metadata</summary>{_pre(run['metadata'])}</details>")
    out.append(f"<details><summary>final state</summary>{_pre(run.get('final_state'))}"
               f"<div class=\"lbl\">flags set: {_e(', '.join(run.get('flags') or []) or 'none')}</div></details>")
    out.append(_close_body(run, judge))
    return "\n".join(out)


def _close_body(run: Mapping[str, Any], judge: Optional[Mapping[str, Any]]) -> str:
    """The end of a run's body: with a judge, the trace's column closes and the verdict's panel follows."""
    if judge is None:
        return "</div></details>"
    return "</div>" + _verdict_html(judge, run.get("usage")) + "</div></details>"


def _conversation_html(run: Mapping[str, Any]) -> str:
    """A session turn by turn: the user's message, the agent's answer, the tool calls between them."""
    session = run.get("session") or {}
    out = [(f"<h3>Conversation</h3><div class=\"lbl\">session {_e(session.get('session_id'))} · "
            f"{_e(_plural(session.get('turns', 0), 'turn'))} · ended: {_e(session.get('ended'))}</div>")]
    turns = run.get("conversation") or []
    for turn in turns:
        calls = " ".join(_pill(f"#{i}") for i in turn.get("tool_calls") or [])
        out.append(f'<div class="msg"><div class="role">turn {_e(turn.get("turn"))} · user</div>'
                   f'<div class="said">{_e(turn.get("user") or "")}</div></div>')
        if turn.get("error"):
            out.append(f'<div class="msg errors"><div class="role">agent</div>{_e(turn["error"])}</div>')
        else:
            done = f" · {session_done_text(turn.get('session_done'), turn is not turns[-1])}"
            out.append(f'<div class="msg"><div class="role">agent{_e(done)}</div>'
                       f'<div class="said">{_e(turn.get("agent") or "")}</div>'
                       + (f'<div class="lbl">tool calls {calls}</div>' if calls else "") + "</div>")
    return "\n".join(out)


def _task_html(run: Mapping[str, Any], simulated: bool = False, trials: int = 1) -> str:
    outcome = run["expected_outcome"] + ("" if run.get("expected_outcome_given") else " (default)")
    how = ("given to the simulated backend's model (--simulator), for the calls it answers" if simulated else
           "shown, not enforced (the platform's simulator applies it with an LLM; --simulator MODEL does here)")
    rows = [
        ("user", f"<pre>{_e(run.get('user_instruction', ''))}</pre>"),
        ("expected outcome", _e(f"{outcome}: {outcome_word(run)}")),
        ("behavior", (f"<pre>{_e(run['behavior_instructions'])}</pre><span class=\"lbl\">{_e(how)}</span>")
         if run.get("behavior_instructions") else '<span class="muted">none</span>'),
        ("run", _e(f"task {run.get('task_id')}, run {run.get('run_id')}"
                   + (f", trial {run.get('trial')} of {trials}" if trials > 1 else "")
                   + f", {run.get('duration_ms', 0):.0f} ms")),
    ]
    rules = run.get("failure_rules") or []
    if rules:
        items = "".join(
            f"<li>[{_e(r['index'])}] {_e(r['summary'])} {_fired_pill(r['fired'])}</li>" for r in rules)
        rows.append(("failure rules", f"<ul>{items}</ul>"))
    if run.get("initial_state"):
        rows.append(("initial state", (f"<details><summary>{_e(_short(run['initial_state'], 80))}</summary>"
                                       f"{_pre(run['initial_state'])}</details>")))
    body = "".join(f"<dt>{_e(k)}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<h3>Task</h3><dl class="task">{body}</dl>'


def _fired_pill(fired: int) -> str:
    return _pill(f"fired {fired}x", "injected" if fired else "")


def _timeline_html(run: Mapping[str, Any]) -> str:
    steps: List[Any] = [("call", c.get("at_ms") or 0, c) for c in run.get("tool_calls") or []]
    in_transcript = _transcript_has_thinking(run.get("messages"))
    steps += [("event", e.get("at_ms") or 0, e) for e in run.get("trace_events") or []
              if not (e.get("event_type") == "thinking" and in_transcript)]  # thinking is shown once
    steps.sort(key=lambda s: s[1])
    if not steps:
        return '<p class="muted">no tool calls and no trace events</p>'
    out = []
    for kind, at, item in steps:
        if kind == "event":
            actor = f" as {item['actor']}" if item.get("actor") else ""
            kind_name, body = _event_html(item)
            out.append(f'<div class="step evt"><div class="head"><span class="t">+{_e(f"{at:.0f}")} ms</span>'
                       f'{_pill("trace")} <span class="name">{_e(kind_name)}</span>{_e(actor)}</div>{body}</div>')
            continue
        source = item.get("source")
        css = {"injected": "inj", "error": "err", None: "err"}.get(source, "")
        pill_css = {"injected": "injected", "odyssey": "odyssey"}.get(source or "", "src-error")
        latency = f" · {item['latency_ms']} ms" if item.get("latency_ms") is not None else ""
        latency = (f" · turn {item['turn']}" if item.get("turn") else "") + latency
        actor = f" · actor {item['actor']}" if item.get("actor") else ""
        out.append(
            f'<div class="step {css}"><div class="head"><span class="t">+{_e(f"{at:.0f}")} ms</span>'
            f'<span class="name">#{_e(item["index"])} {_e(item["tool_name"])}</span>'
            f"{_pill(_source_label(item), pill_css)}<span class=\"lbl\">{_e(latency + actor)}</span></div>"
            f'<div class="cols"><div><div class="lbl">arguments</div>{_pre(item.get("arguments"))}</div>'
            f'<div><div class="lbl">response</div>{_pre(item.get("response"))}</div></div>'
            f"{_changes_html(item.get('changes') or [])}</div>"
        )
    return "\n".join(out)


_TEXT_EVENTS = ("assistant_message", "thinking", "system_prompt", "subagent_message", "subagent_final")


def _event_html(event: Mapping[str, Any]) -> Tuple[str, str]:
    """A trace event rendered by its type: (the name shown, the body); metadata keys (``__...``) left out."""
    kind = str(event.get("event_type"))
    payload = event.get("payload")
    fields = {k: v for k, v in payload.items() if not str(k).startswith("__")} if isinstance(payload, dict) else {}
    turn = f'<div class="turn">turn {_e(fields["turn"])}</div>' if "turn" in fields else ""
    if kind in _TEXT_EVENTS and isinstance(fields.get("text"), str):
        rest = {k: v for k, v in fields.items() if k not in ("text", "turn")}
        extra = _pre(rest) if rest else ""
        return kind.replace("_", " "), f'{turn}<div class="said">{_e(fields["text"])}</div>{extra}'
    if kind == "handoff":
        line = f"{fields.get('from_sub_agent')} → {fields.get('to_sub_agent')}"
        if fields.get("reason"):
            line += f": {fields['reason']}"
        return "handoff", f'<div class="said">{_e(line)}</div>'
    if kind == "custom" and fields.get("event") == "model_turn":
        parts = [f"turn {fields.get('turn')}"] if "turn" in fields else []
        if isinstance(fields.get("latency_ms"), (int, float)):
            parts.append(f"{fields['latency_ms']:.0f} ms")
        if "input_tokens" in fields or "output_tokens" in fields:
            parts.append(f"{fields.get('input_tokens', '?')} in / {fields.get('output_tokens', '?')} out tokens")
        if "tool_calls" in fields:
            parts.append(_plural(int(fields["tool_calls"] or 0), "tool call"))
        return "model turn", f'<div class="turn">{_e(" · ".join(parts))}</div>'
    return kind.replace("_", " "), _pre(fields if isinstance(payload, dict) else payload)


def _transcript_has_thinking(messages: Any) -> bool:
    return isinstance(messages, list) and any(isinstance(m, dict) and m.get("thinking") for m in messages)


def _changes_html(changes: List[Mapping[str, Any]]) -> str:
    if not changes:
        return ""
    rows = []
    for change in changes:
        op = change.get("op")
        if op == "set_flag":
            rows.append(f"<tr><td>set_flag</td><td colspan=\"3\">{_e(change.get('flag'))}</td></tr>")
            continue
        entity = _e(f"{change.get('entity_type')} {change.get('entity_id')}")
        before, after = change.get("before") or {}, change.get("after") or {}
        keys = [k for k in sorted(set(before) | set(after)) if before.get(k) != after.get(k) or op != "update"]
        if not keys:
            rows.append(f"<tr><td>{_e(op)}</td><td>{entity}</td><td colspan=\"2\">no change</td></tr>")
        for k in keys:
            old = f'<span class="before">{_e(before[k])}</span>' if k in before else ""
            new = f'<span class="after">{_e(after[k])}</span>' if k in after else ""
            arrow = " → " if old and new else " "
            rows.append(f"<tr><td>{_e(op)}</td><td>{entity}</td><td>{_e(k)}</td><td>{old}{arrow}{new}</td></tr>")
    return f'<div class="lbl">ledger changes</div><table class="diff">{"".join(rows)}</table>'


def _message_html(message: Any) -> str:
    if not isinstance(message, dict):
        return f'<div class="msg">{_pre(message)}</div>'
    role = message.get("role", "?")
    parts = [(f'<div class="msg"><div class="role">{_e(role)}'
              f"{' · ' + _e(message['tool_call_id']) if message.get('tool_call_id') else ''}</div>")]
    content = message.get("content")
    if isinstance(content, str):
        parts.append(f'<div style="white-space:pre-wrap">{_e(content)}</div>')
    elif content is not None:
        parts.append(_pre(content))
    thinking = message.get("thinking")
    for item in thinking if isinstance(thinking, list) else [thinking] if thinking is not None else []:
        text = item.get("text") if isinstance(item, dict) and "text" in item else item
        parts.append(f"<details><summary class=\"lbl\">thinking</summary>{_pre(text)}</details>")
    tool_calls = message.get("tool_calls")
    for call in tool_calls if isinstance(tool_calls, list) else [tool_calls] if tool_calls is not None else []:
        if not isinstance(call, dict):
            parts.append(f'<div><span class="lbl">tool call</span>{_pre(call)}</div>')
            continue
        function = call.get("function") if isinstance(call.get("function"), dict) else call
        name, args = function.get("name"), function.get("arguments")
        parts.append(f'<div><span class="lbl">tool call {_e(call.get("id") or "")}</span> '
                     f'<span class="name">{_e(name)}</span>{_pre(args)}</div>')
    parts.append("</div>")
    return "".join(parts)


def write_reports(result: Mapping[str, Any], json_path: Optional[str], html_path: Optional[str],
                  write: Callable[[str, str], None]) -> None:
    """The JSON report to ``json_path`` (``-``: standard output) and the HTML one to ``html_path``, through
    ``write(path, text)`` (the command's own writer, with its own error)."""
    if json_path:
        text = json.dumps(result, indent=2, ensure_ascii=False, default=str)
        if json_path == "-":
            print(text)
        else:
            write(json_path, text + "\n")
    if html_path:
        write(html_path, render_html(result))


def write_file(path: str, text: str) -> None:
    """``text`` into ``path`` whole or not at all: a temporary file beside it, then renamed; raises ``OSError``."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ---------------------------------------------------------------------------
# A comparison of two reports (compare.py)
# ---------------------------------------------------------------------------

_CHANGES = (("regressed", "regressed", "its share of passing trials fell"),
            ("fixed", "fixed", "its share of passing trials rose"),
            ("added", "added", "a row (a seed) the baseline does not have"),
            ("removed", "removed", "a row (a seed) only the baseline has"))


def _side(side: Mapping[str, Any]) -> str:
    """One report in a line: its file, rows and trials, pass rate and pass^k, judge."""
    k = side.get("trials", 1)
    rates = f"pass rate {side.get('pass_rate', 0.0):.1%}" + (f", pass^{k} {side.get('pass_hat_k', 0.0):.1%}"
                                                             if k > 1 else "")
    return (f"{side.get('file')}: {_plural(side.get('rows', 0), 'row')}"
            + (f", {k} trials each" if k > 1 else "") + f", {rates}, judge {side.get('judge', {}).get('model')}")


def _row_change(entry: Mapping[str, Any]) -> str:
    """``row 2 -> row 3``, ``row 5`` (added: its new number), ``row 4`` (removed: its old one)."""
    rows = entry.get("row") or {}
    before, after = rows.get("before"), rows.get("after")
    if before is not None and after is not None:
        return f"row {before}" if before == after else f"row {before} -> row {after}"
    return f"row {after if after is not None else before}"


def render_comparison_text(comparison: Mapping[str, Any]) -> str:
    """The comparison for the terminal: the notes first, the two reports, the counts, then each changed row."""
    lines = [f"NOTE: {note}" for note in comparison.get("notes") or []]
    lines += [f"before: {_side(comparison['before'])}", f"after:  {_side(comparison['after'])}"]
    counts = [f"{len(comparison[key])} {word}" for key, word, _ in _CHANGES]
    lines.append(", ".join([*counts[:2], f"{comparison['unchanged']} unchanged", *counts[2:]]))
    for key, word, _ in _CHANGES:
        if not comparison[key]:
            continue
        lines += ["", f"{word}:"]
        for entry in comparison[key]:
            modes = entry.get("failure_modes") or {}
            why = "; ".join(f"{side}: {', '.join(modes[side])}" for side in ("before", "after") if modes.get(side))
            lines.append(f"  {_row_change(entry)}  {entry.get('before') or '-'} -> {entry.get('after') or '-'}  "
                         f"{_short(entry.get('user_instruction') or '', 70)}" + (f"  [{why}]" if why else ""))
    return "\n".join(lines)


def render_comparison_html(comparison: Mapping[str, Any]) -> str:
    """The comparison as one self-contained page: the notes, the two reports, a table per kind of change."""
    before, after = comparison["before"], comparison["after"]
    title = f"Comparison: {before.get('file')} → {after.get('file')}"
    pills = [_pill(f"{len(comparison['regressed'])} regressed", "fail" if comparison["regressed"] else ""),
             _pill(f"{len(comparison['fixed'])} fixed", "pass" if comparison["fixed"] else ""),
             _pill(f"{comparison['unchanged']} unchanged"), _pill(f"{len(comparison['added'])} added"),
             _pill(f"{len(comparison['removed'])} removed")]
    parts = [_head(title),
             (f'<header><h1>{_e(title)}</h1><div class="meta">before: {_e(_side(before))}</div>'
              f'<div class="meta">after: {_e(_side(after))}</div><div class="summary">{"".join(pills)}</div>'
              "</header><main>")]
    if comparison.get("notes"):
        parts.append('<div class="warnings" id="notes"><ul>'
                     + "".join(f"<li><b>Note:</b> {_e(n)}</li>" for n in comparison["notes"]) + "</ul></div>")
    for key, word, meaning in _CHANGES:
        entries = comparison[key]
        parts.append(f'<h3 id="{key}">{_e(word)} ({len(entries)})</h3><p class="muted">{_e(meaning)}</p>')
        if not entries:
            continue
        rows = "".join(
            f"<tr><td>{_e(_row_change(entry))}</td><td>{_e(entry.get('before') or '-')}</td>"
            f"<td>{_e(entry.get('after') or '-')}</td><td>{_e(_modes_text(entry, 'before'))}</td>"
            f"<td>{_e(_modes_text(entry, 'after'))}</td><td>{_e(_short(entry.get('user_instruction') or '', 120))}</td>"
            "</tr>" for entry in entries)
        parts.append(f'<table class="trials {key}"><tr><th>row</th><th>before</th><th>after</th>'
                     f"<th>failure modes before</th><th>failure modes after</th><th>user instruction</th></tr>{rows}"
                     "</table>")
    parts.append("</main></body></html>")
    return "\n".join(parts) + "\n"


def _modes_text(entry: Mapping[str, Any], side: str) -> str:
    modes = (entry.get("failure_modes") or {}).get(side)
    return ", ".join(modes) if modes else ""
