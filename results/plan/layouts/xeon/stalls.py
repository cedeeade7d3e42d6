import json,sys,collections
for path in sys.argv[1:]:
    runs=collections.defaultdict(list)
    for line in open(path):
        r=json.loads(line)
        runs[r['run']].append(r)
    for run,rs in runs.items():
        ev=[]
        for r in rs:
            t=r['token_times_s']
            for a,b in zip(t,t[1:]):
                if b-a>0.5: ev.append((round(b,2),round(b-a,3),r['index'],r['kind']))
        longs=[(r['index'],round(r['sent_s'],2)) for r in rs if r['kind']=='long']
        byend=collections.Counter(e[0] for e in ev)
        print(run, 'gaps>0.5s:',len(ev), 'distinct ends:', sorted(byend.items())[:8], 'longs', longs[:4])
