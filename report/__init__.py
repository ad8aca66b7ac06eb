"""The scaling report: one self-contained plotly HTML page from simulation records, timelines and traces.

Public surface: `build_report`, `write_report`, `load_records`, `load_timeline`, `load_validation`,
`ReportInputError`.
docs/report.md explains every section.
"""

from .errors import ReportInputError
from .html import build_report
from .inputs import RECORDS_SCHEMA, load_records, load_timeline, write_text_atomically
from .validation import load_validation

write_report = write_text_atomically

__all__ = [
    "RECORDS_SCHEMA",
    "ReportInputError",
    "build_report",
    "load_records",
    "load_timeline",
    "load_validation",
    "write_report",
]
