"""`python -m torch_hca.explain`: the plan of a collective, printed (see the package's docstring)."""
import argparse

from .. import topology
from ..bench import int_list_arg
from . import __doc__ as DOC, explain


def _ranks_lists(text):
    """ "0,1;2,3" -> [[0, 1], [2, 3]] (argparse's type of the options that take one list per rank or group)"""
    try:
        return [[int(r) for r in part.split(",")] for part in text.split(";")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lists of integers such as 0,1;2,3, got {text!r}") from None


def _groups(text):
    return text if text in ("auto", "halves") else _ranks_lists(text)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m torch_hca.explain", description=DOC.splitlines()[0])
    parser.add_argument("world_size", type=int)
    parser.add_argument("--algorithm", default=None)
    parser.add_argument("--num-packs", type=int, help="default: chosen per call")
    parser.add_argument("--groups", type=_groups, help='e.g. "0,1,2,3;4,5,6,7"')
    parser.add_argument("--reduce-to-device", type=int)
    parser.add_argument("--numels", type=int_list_arg("comma-separated integers"), default="1024",
                        help="comma-separated tensor sizes")
    parser.add_argument("--collective", default="allreduce", choices=["allreduce", "reduce", "broadcast"])
    parser.add_argument("--root", type=int, default=0)
    parser.add_argument("--slot-bytes", type=int, help="staging slot size for the rounds (default: the shm slot)")
    parser.add_argument("--nodes", help='each rank\'s node, e.g. "a,a,b,b" (allreduce across nodes)')
    parser.add_argument("--numa-nodes", type=_ranks_lists,
                        help='each rank\'s NUMA nodes, e.g. "0;1;0;1" (groups="auto")')
    parser.add_argument("--packages", type=_ranks_lists,
                        help='each rank\'s CPU packages, e.g. "0;0;1;1" (groups="auto")')
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--gpus", help='each rank\'s GPU, e.g. "0,0,0,0" (--device cuda)')
    parser.add_argument("--links", choices=list(topology.LINK_LAYOUTS),
                        help="how the GPUs of --gpus are linked, as if on such a machine (--device cuda)")
    parser.add_argument("--here", action="store_true", help="print where this process runs (what it would report)")
    args = parser.parse_args(argv)
    if args.here:
        print(f"this process: {topology.detect()}")
    try:
        explain(args.world_size, args.algorithm, args.num_packs, args.groups, args.reduce_to_device, args.numels,
                args.collective, args.root, verbose=True, slot_bytes=args.slot_bytes,
                nodes=args.nodes.split(",") if args.nodes else None, numa_nodes=args.numa_nodes,
                packages=args.packages, device=args.device, gpus=args.gpus.split(",") if args.gpus else None,
                links=args.links)
    except ValueError as e:  # what the options and the plan refuse, as the usage line's errors
        parser.error(str(e))


main()
