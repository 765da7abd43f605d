"""The dashboard's stylesheet, inlined in the page (no asset files to package)."""

CSS = """
:root { --fg: #1d2330; --muted: #5b6475; --line: #dde2ea; --bg: #f6f7f9; --accent: #2458c6; --bad: #b42318;
        --ok: #1e7a3c; --warn: #a15c00; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: var(--fg);
       background: var(--bg); }
a { color: var(--accent); text-decoration: none; }
a:hover { text-decoration: underline; }
header.top { display: flex; align-items: center; gap: 18px; padding: 8px 20px; background: #18202f; color: #fff; }
header.top a { color: #dfe7f7; }
.brand { font-weight: 700; font-size: 17px; color: #fff !important; letter-spacing: .3px; }
.topnav { display: flex; gap: 14px; }
.auth { margin-left: auto; display: flex; align-items: center; gap: 6px; font-size: 12px; color: #c9d2e3; }
.auth .who { font-weight: 600; color: #fff; }
.auth .bad { color: #ffb4ab; }
.token-input { width: 190px !important; height: 28px !important; }
.page { max-width: 1340px; margin: 0 auto; padding: 12px 20px 40px; }
h1 { font-size: 21px; margin: 6px 0 8px; }
h2 { font-size: 16px; margin: 20px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 14px; margin: 14px 0 6px; }
.run-name { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; }
.run-head { display: flex; align-items: flex-end; gap: 24px; flex-wrap: wrap; border-bottom: 1px solid var(--line);
            margin-bottom: 10px; }
.cl-tabs { display: flex; gap: 2px; flex-wrap: wrap; }
.cl-tab { white-space: nowrap; flex-shrink: 0; padding: 6px 12px; border: 1px solid transparent; border-bottom: none; border-radius: 6px 6px 0 0;
       color: var(--muted); }
.cl-tab.active { background: #fff; border-color: var(--line); color: var(--fg); font-weight: 600; }
.controls { display: flex; flex-wrap: wrap; gap: 10px 16px; align-items: flex-end; background: #fff;
            border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px; margin-bottom: 10px; }
.controls .field > label, .field > label { display: block; font-size: 11px; color: var(--muted); text-transform: uppercase;
                                letter-spacing: .4px; margin-bottom: 2px; }
.controls .field { min-width: 110px; }
.controls .field.wide { min-width: 260px; }
select, textarea { padding: 4px 6px; border: 1px solid #c5ccd8; border-radius: 4px; font: inherit; background: #fff; }
.controls .dash-input-container { min-width: 110px; }
.card { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; margin-bottom: 12px; }
.grid2 { display: grid; grid-template-columns: minmax(0, 1fr) minmax(0, 1fr); gap: 12px; }
.grid3 { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 12px; }
@media (max-width: 1100px) { .grid2, .grid3 { grid-template-columns: minmax(0, 1fr); } }
table.data { border-collapse: collapse; width: 100%; font-size: 12.5px; background: #fff; margin: 4px 0 8px; }
table.data th { text-align: left; font-weight: 600; color: var(--muted); border-bottom: 2px solid var(--line);
                padding: 4px 8px; white-space: nowrap; position: sticky; top: 0; background: #fff; }
table.data td { border-bottom: 1px solid #edf0f4; padding: 3px 8px; vertical-align: top; }
table.data td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.data tr.flag td { background: #fff4e5; }
table.data tr.bad td { background: #fdecea; }
table.data caption { text-align: left; font-weight: 600; padding: 4px 0; }
.md-table table { border-collapse: collapse; width: 100%; font-size: 12.5px; background: #fff; margin: 0; }
.md-table th { text-align: left; font-weight: 600; color: var(--muted); border-bottom: 2px solid var(--line);
               padding: 4px 8px; white-space: nowrap; position: sticky; top: 0; background: #fff; }
.md-table td { border-bottom: 1px solid #edf0f4; padding: 3px 8px; vertical-align: top;
               font-variant-numeric: tabular-nums; word-break: break-word; }
.md-table p { margin: 0; }
.scroll { max-height: 420px; overflow: auto; border: 1px solid var(--line); border-radius: 6px; }
.scroll.short { max-height: 300px; }
.chart { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 6px 10px 8px; margin-bottom: 12px; }
.chart details summary { cursor: pointer; color: var(--accent); font-size: 12.5px; }
.chart .csv { font-size: 12.5px; margin-left: 2px; }
.chart-note { font-size: 12px; color: var(--muted); }
.msg { padding: 8px 12px; border-radius: 6px; margin: 6px 0; border: 1px solid; }
.msg-error { background: #fdecea; border-color: #f5c2bd; color: var(--bad); }
.msg-empty, .msg-info { background: #f1f4f9; border-color: var(--line); color: var(--muted); }
.msg-ok { background: #e9f6ee; border-color: #bfe3cc; color: var(--ok); }
.msg-warn { background: #fff4e5; border-color: #f3d19e; color: var(--warn); }
.hint { color: var(--muted); font-size: 12.5px; margin: 4px 0; }
.btn { padding: 5px 12px; border-radius: 5px; border: 1px solid var(--accent); background: var(--accent); color: #fff;
       cursor: pointer; font: inherit; }
.btn.small { padding: 2px 8px; font-size: 12px; }
.btn.ghost { background: transparent; color: inherit; border-color: #667; }
.btn.light { background: #fff; color: var(--accent); }
.kv { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 0; }
.kv dt { color: var(--muted); }
.kv dd { margin: 0; }
.badge { display: inline-block; padding: 0 6px; border-radius: 9px; font-size: 11px; font-weight: 600;
         background: #e6e9ef; color: var(--fg); margin-right: 4px; }
.sev-high { background: #fdd; color: #8a1111; } .sev-medium { background: #ffe9c7; color: #7a4500; }
.sev-low { background: #e3ecfb; color: #1c3f86; } .sev-info { background: #eceff3; }
.st-open { background: #e3ecfb; color: #1c3f86; } .st-resolved { background: #e3f4e8; color: #1e5a30; }
.st-ok { background: #e3f4e8; color: #1e5a30; } .st-failed { background: #fdd; color: #8a1111; }
.st-duplicate, .st-partly { background: #fff0c7; color: #6b5300; }
.tag { display: inline-block; padding: 0 7px; margin: 0 3px 2px 0; border-radius: 9px; background: #eef2fb;
       font-size: 11.5px; }
.upload { border: 2px dashed #9fb0cc; border-radius: 8px; padding: 14px; text-align: center; background: #fff;
          cursor: pointer; color: var(--muted); }
progress { width: 100%; height: 14px; }
.finding { border-left: 4px solid var(--line); padding: 4px 10px; margin: 6px 0; background: #fff; }
.finding.high { border-color: #d92d20; } .finding.medium { border-color: #f79009; } .finding.low { border-color: #5b8def; }
.finding .title { font-weight: 600; }
.review-item { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 8px 12px; margin: 8px 0; }
.review-item.selected { border-color: var(--accent); box-shadow: 0 0 0 2px #c9d8f5; }
.review-item .meta { font-size: 12px; color: var(--muted); display: flex; gap: 10px; align-items: center; flex-wrap: wrap; }
.review-item .author { font-weight: 600; color: var(--fg); }
.replies { margin-left: 22px; border-left: 2px solid var(--line); padding-left: 10px; }
.reply-row { display: flex; gap: 6px; align-items: flex-start; margin-top: 6px; }
.reply-row textarea { flex: 1; height: 34px; }
.comment-box { margin-top: 16px; background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 6px 12px; }
.comment-box summary { cursor: pointer; font-weight: 600; color: var(--accent); }
.comment-text { width: 100%; height: 70px; display: block; margin: 6px 0; }
.markdown p { margin: 4px 0; }
.markdown pre { background: #f3f5f8; padding: 6px; overflow: auto; }
.markdown table { border-collapse: collapse; } .markdown td, .markdown th { border: 1px solid var(--line); padding: 2px 6px; }
.pager { display: flex; gap: 12px; align-items: center; font-size: 12.5px; color: var(--muted); margin: 4px 0; }
.whatif { display: grid; grid-template-columns: repeat(8, minmax(0, 1fr)); gap: 6px 10px; align-items: end; }
.whatif .Select, .whatif .dash-dropdown { min-width: 0; }
.note-list { color: var(--muted); font-size: 12.5px; margin: 4px 0 4px 18px; padding: 0; }
.mono { font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 12px; }
table.data .mono { word-break: break-all; }
.tags-input { width: 100%; max-width: 420px; display: block; margin-bottom: 4px; }
"""
