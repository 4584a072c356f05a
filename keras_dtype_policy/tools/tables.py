"""Plain-text tables for the command line's reports."""

import numbers
import textwrap

WIDTH = 79


class RowsReport:
    """A report of `rows` that prints as the lines of its `format()`.

    Mixed into the dataclasses of the tools' results (`AuditTable`,
    `LostUpdates`): iterating gives the rows, `len` counts them and `str`
    is the text report.
    """

    def format(self):
        """Returns the report as lines of text."""
        raise NotImplementedError

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __str__(self):
        return "\n".join(self.format())


def format_table(header, rows, indent="", align=None):
    """Returns the lines of an aligned text table.

    Columns are as wide as their widest cell. Numbers are right-aligned,
    everything else left-aligned; a rule of dashes follows the header.

    Args:
        header: The column titles.
        rows: Sequences of cells, as many as there are titles. Cells are
            printed with `str`, except floats, which the caller formats.
        indent: A prefix for every line.
        align: Optional, one letter per column, `"l"` or `"r"`, instead of
            aligning by the cells' types.

    Returns:
        A list of strings without trailing spaces.

    Example:

    >>> for line in format_table(("layer", "params"), [("dense", 80)]):
    ...     print(line)
    layer  params
    -----  ------
    dense      80
    """
    header = [str(title) for title in header]
    cells = [[_text(cell) for cell in row] for row in rows]
    if align is None:
        right = [
            bool(rows) and all(_is_number(row[i]) for row in rows)
            for i in range(len(header))
        ]
    else:
        right = [letter == "r" for letter in align]
    widths = [
        max([len(header[i]), *(len(row[i]) for row in cells)])
        for i in range(len(header))
    ]

    def line(texts):
        padded = [
            text.rjust(width) if align_right else text.ljust(width)
            for text, width, align_right in zip(
                texts, widths, right, strict=True
            )
        ]
        return (indent + "  ".join(padded)).rstrip()

    return [
        line(header),
        line(["-" * width for width in widths]),
        *(line(row) for row in cells),
    ]


def format_bytes(count):
    """Returns a byte count for people: `"1.5 MiB"`, `"312 B"`.

    Args:
        count: A number of bytes, or None for "n/a".
    """
    if count is None:
        return "n/a"
    value = float(count)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def wrap(text, indent="", bullet=""):
    """Returns `text` as lines of at most `WIDTH` columns.

    Args:
        text: One paragraph.
        indent: A prefix for every line.
        bullet: A prefix for the first line instead of `indent` (such as
            `"  - "`); the next lines are indented as deep.
    """
    first = bullet or indent
    return textwrap.wrap(
        text,
        width=WIDTH,
        initial_indent=first,
        subsequent_indent=" " * len(first) if bullet else indent,
        break_long_words=False,
        break_on_hyphens=False,
    ) or [first.rstrip()]


def _is_number(cell):
    return isinstance(cell, numbers.Number) and not isinstance(cell, bool)


def _text(cell):
    if cell is None:
        return "-"
    return str(cell)
