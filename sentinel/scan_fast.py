"""The fast path of ``sentinel scan``: runs of lines that cannot matter, passed over in C.

Nearly every line of a kernel log is a kernel message behind a known prefix that no catalog entry
can match: its message starts with no entry's prefix (nor a part a split message is joined by) and
the line holds no wildcard entry's needle. Such a line is a record of its own that matches nothing;
the only trace it leaves is the counts (a line, a kernel message) and the end of the record before
it. :func:`read_lines` finds runs of them with one regular expression built from the log-format
reader's own patterns (:data:`sentinel.sources.kmsg._READERS`, in their order of precedence, so a
line is boring only where the reader would read it as that kernel message) and hands a run over as
``(first line number, count)``; every other line is read one by one, as before. The run's last
record stays open in the record assembly (a record that matches nothing), so a continuation line
after the run continues it, as it would have. The result is the same as reading every line (tests/test_scan_property.py, and the
``scan_fast`` tests compare the two paths on every corpus and capture).
"""

from __future__ import annotations

import re
from typing import IO, Iterator

from sentinel import signatures
from sentinel.records import MAX_LINE
from sentinel.sources import kmsg

BLOCK = 1 << 20
MAX_BORING = 8000  # characters: a boring line is printable ASCII, far below MAX_LINE bytes
_NAMED = re.compile(r"\(\?P<[A-Za-z_]\w*>")


def _within_a_line(pattern: str) -> str:
    """A reader pattern for one line of a multi-line text: no named groups, whitespace that
    cannot cross a newline, and the end of the line where the reader has the end of the text."""
    return _NAMED.sub("(?:", pattern).replace("\\s", "[ \\t]").replace("$", "(?=\\n)")


def boring_regex(catalog: signatures.Catalog) -> tuple[re.Pattern[str], tuple[str, ...]]:
    """(runs of boring lines, the texts that make a line interesting wherever they are).

    A line's first character says which of the reader's alternatives can match it at all; of
    those, each is tried behind the ones that take precedence over it and could match the same
    line (the others cannot: a dmesg time and a caller id, a wrapper or a Talos host never start
    one line alike; each pair is checked in tests/test_scan_fast.py). Each prefix is an atomic
    group: it ends where the reader's own match ends (the first way the pattern matches, as
    ``re.match`` finds it), so the check of the message's start that follows can never be met by a
    shorter reading of the prefix. Where a boring pattern is narrower than the reader's (blanks
    for any white space, an ASCII host), a line it misses is read one by one: never wrong, only slower."""
    alt = {name: _within_a_line(p) for name, p in _alternatives().items()}
    ts = _within_a_line(kmsg._DMESG_TS)
    syslog = alt["syslog"].replace(r"(?:\S* )?", r"(?:[!-~]{0,253}+ )?")  # an ASCII host name, as long as DNS allows
    after_tag = rf"(?>kernel(?:\[\d{{1,10}}\])?:(?: |(?=\n)|(?=\[)))?+(?>(?:{ts}[ \t]?)?)"  # _after_kernel_tag
    kern_kmsg = rf"(?>0{{0,2}}[0-7],\d{{1,20}},\d{{1,20}},[^;\s]{{0,64}};|<0{{0,2}}[0-7]>[ \t]*(?:{ts}[ \t]?)?)"
    not_monotonic = r"(?![!-~]++ kernel: )"  # "[time] host kernel: " is journalctl's short-monotonic, not dmesg
    kern_decode = rf"(?>kern(?![a-z0-9])[ \t]*:[ \t]*{kmsg._LEVELS}[ \t]*:[ \t]?(?:(?:{ts}|{kmsg._ISO})[ \t]?)?)"
    kern_talos = rf"(?>[!-~]{{1,253}}: kern:[ \t]{{0,8}}{kmsg._LEVELS}[a-z]{{0,3}}: \[{kmsg._ISO}\]: )"
    bracket = rf"(?>{alt['dmesg']}){not_monotonic}"
    # a line that starts with a letter: Talos (a host name), dmesg -x (a facility) or syslog (a month);
    # no two of them can start one line (the host is followed by ': ', the facility by ':', the month by a day)
    letter = rf"(?:{kern_talos}|(?!{alt['talos']})(?:{kern_decode}|(?>{syslog}){after_tag}))"
    # containerd / CRI-O: the first wrapper that can start a line with a digit; what follows is read again
    cri = rf"(?>{kmsg._ISO} (?:stdout|stderr) [FP] )[ \t]*+(?=\[){bracket}"
    digit = (rf"(?:{cri}|(?!{alt['wrapper']})(?:{kern_talos}|(?!{alt['talos']})(?:{kern_kmsg}{after_tag}|(?!{alt['kmsg']})"
             rf"(?:(?>{syslog}){after_tag}|(?!{alt['syslog']})(?>{alt['dmesg']})))))")
    raw = rf"{kern_kmsg}{after_tag}"
    starts = sorted({p for s in catalog.signatures for p in (*s.prefixes, *s.joins)}, key=len, reverse=True)
    first = "".join(sorted({re.escape(s[0]) for s in starts}))
    message = (r"[ \t]*+(?>(?:\[[ \t]{0,8}[TC]\d{1,7}\][ \t]?)?)[ \t]*+"  # the caller id parse_log_line takes off
               rf"(?!(?=[{first}])(?:{'|'.join(map(re.escape, starts))}))[\t\x20-\x7e]{{0,{MAX_BORING}}}\n")
    line = rf"(?:(?=\[){bracket}|(?=[A-Za-z]){letter}|(?=\d){digit}|(?=<){raw}){message}"
    needles = tuple(sorted({s.needle for s in catalog.signatures if s.needle} | {"\\x0a"}))
    return re.compile(rf"(?:{line})+"), needles


def _alternatives() -> dict[str, str]:
    """The reader's alternatives the boring line is made of, as the reader writes them."""
    out = {}
    for pattern in (kmsg._WRAPPER, *kmsg._READERS):
        name = re.match(r"\(\?P<(\w+)>", pattern).group(1)
        out[name] = pattern
    return out


def read_lines(stream: IO[bytes], stats, slow_line, catalog: signatures.Catalog) -> Iterator[tuple[int, object]]:
    """(line number, text) for each line to read one by one, (first line number, count) for a run
    of boring lines. ``slow_line(lineno, raw, text=None)`` reads one line as ``sentinel.scan``
    does, from its bytes or its decoded text (None: malformed, counted; ``raw`` and ``text`` both
    None: longer than MAX_LINE). Such a line is never held whole."""
    runs, needle = _compiled(catalog)
    lineno, carry, skipping = 0, b"", False
    while True:
        block = stream.read(BLOCK)
        if not block:
            if carry and not skipping:
                lineno += 1
                stats.lines += 1
                text = slow_line(lineno, carry)
                if text is not None:
                    yield lineno, text
            return
        data = carry + block
        end = data.rfind(b"\n")
        if end < 0:
            carry = b"" if skipping else data
            if len(carry) >= MAX_LINE:  # an overlong line: malformed, the rest of it skipped
                lineno += 1
                stats.lines += 1
                slow_line(lineno, None)
                carry, skipping = b"", True
            continue
        complete, carry = data[:end + 1], data[end + 1:]
        if skipping:
            complete, skipping = complete[complete.find(b"\n") + 1:], False
        yield from _complete_lines(complete, lineno, stats, slow_line, runs, needle)
        lineno += complete.count(b"\n")
        if len(carry) >= MAX_LINE:
            lineno += 1
            stats.lines += 1
            slow_line(lineno, None)
            carry, skipping = b"", True


def _compiled(catalog: signatures.Catalog) -> tuple[re.Pattern[str], tuple[str, ...]]:
    """The catalog's boring-run regex, built once and kept on the catalog (immutable) itself."""
    built = getattr(catalog, "_boring", None)
    if built is None:
        built = boring_regex(catalog)
        object.__setattr__(catalog, "_boring", built)
    return built


def _complete_lines(complete: bytes, lineno: int, stats, slow_line, runs, needle) -> Iterator[tuple[int, object]]:
    """The lines of ``complete`` (whole lines, each ending with a newline), after ``lineno``."""
    try:
        text = complete.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:  # read every line as bytes, as the slow path does
        for raw in complete.split(b"\n")[:-1]:
            lineno += 1
            stats.lines += 1
            line = slow_line(lineno, raw + b"\n")
            if line is not None:
                yield lineno, line
        return
    pos, size = 0, len(text)

    ahead = {n: text.find(n) for n in needle}  # each needle's next place, found again only once passed

    def line_of_next_needle(start: int) -> int:
        first = size
        for n, at in ahead.items():
            if 0 <= at < start:
                at = ahead[n] = text.find(n, start)
            if 0 <= at < first:
                first = at
        return size if first == size else text.rfind("\n", 0, first) + 1

    limit = line_of_next_needle(0)
    while pos < size:
        if limit < pos:
            limit = line_of_next_needle(pos)
        if pos < limit:
            m = runs.match(text, pos, limit)
            if m is not None:
                count = text.count("\n", pos, m.end())
                yield lineno + 1, count
                lineno += count
                stats.lines += count
                pos = m.end()
                continue
        nl = text.find("\n", pos)
        lineno += 1
        stats.lines += 1
        line = slow_line(lineno, None, text[pos:nl])
        if line is not None:
            yield lineno, line
        pos = nl + 1
