"""``python -m torch_hca.fr_trace <folder>``: torch's Flight Recorder analyzer over dumps with hca's calls.

torch's analyzer before 2.15 reads the entries of a fixed set of communication
libraries and stops at any other's; this runs it, with its own arguments, reading
hca's entries as it reads gloo's. From torch 2.15 on, torch's own reads them too.
"""

import sys

from torch.distributed.flight_recorder import fr_trace
from torch.distributed.flight_recorder.components import types


def _reading_hca_entries() -> None:
    read = types.Op.__init__
    if getattr(read, "reads_hca", False):
        return

    def read_any(self, event, memberships, pg_name):
        library, _, op = event["profiling_name"].partition(":")
        if library != "hca":
            return read(self, event, memberships, pg_name)
        read(self, {**event, "profiling_name": "gloo:" + op}, memberships, pg_name)
        self.profiling_name = event["profiling_name"]

    read_any.reads_hca = True
    types.Op.__init__ = read_any


def main(argv=None) -> None:
    _reading_hca_entries()
    fr_trace.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
