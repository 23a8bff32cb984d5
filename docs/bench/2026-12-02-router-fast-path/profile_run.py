import cProfile, signal, sys
out = sys.argv[1]; sys.argv = ["expresslane.router"] + sys.argv[2:]
import time; pr = cProfile.Profile(time.process_time)
def dump(*a):
    pr.disable(); pr.dump_stats(out)
signal.signal(signal.SIGUSR1, dump)
from expresslane.router.__main__ import main
pr.enable()
main()
