"""``python -m torch_hca.fr_trace <folder>``: torch's Flight Recorder analyzer over dumps with hca's calls.

It runs torch's analyzer with its own arguments, with two differences:
- it reads hca's entries as it reads gloo's (before torch 2.15 the analyzer reads the entries of a
  fixed set of communication libraries and stops at any other's);
- it leaves out the entries of groups torch never named: the gloo groups hca makes between the
  leaders of nodes, which gloo enters itself, under no name and each node's own numbering, and
  which the analyzer would report as calls some ranks never joined. Their group's own call, the
  one the user made, is hca's entry.
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


def _named_groups_only(read_dir):
    def read(args):
        details, version = read_dir(args)
        for dump in details.values():
            dump["entries"] = [e for e in dump["entries"] if any(e["process_group"])]
            dump["pg_config"] = {name: group for name, group in dump["pg_config"].items() if name}
        return details, version

    return read


def main(argv=None) -> None:
    _reading_hca_entries()
    fr_trace.read_dir = _named_groups_only(fr_trace.read_dir)
    fr_trace.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
