# gnuplot -e "data='state.dat'; out='bench/state_per_rank.png'" bench/state_per_rank.gp
# Columns of //bench:state_per_rank: world, unsharded, sorted-greedy max/min, flat max/min, ideal,
# then gradients per rank: DDP + ZeRO-1 (every gradient), ZeRO-2 max, ZeRO-2 in flight, ZeRO-2 state.
set terminal pngcairo size 900,560 font ",11"
set output out
set title "Memory on the largest rank, GPT-2-shaped model (22.6M parameters, embedding 57%)"
set xlabel "ranks (world size)"
set ylabel "Adam state or gradients per rank (MiB)"
set xrange [0.8:8.2]
set yrange [0:200]
set xtics 1
set grid
set key at graph 0.98, 0.88 right top opaque box
plot data using 1:2 with linespoints lw 2 pt 7 title "unsharded (every rank holds all)", \
     data using 1:3 with linespoints lw 2 pt 5 title "ZeRO sorted-greedy (PyTorch's partition)", \
     data using 1:5 with linespoints lw 2 pt 9 title "ZeRO flat (dtrain)", \
     data using 1:7 with lines dt 2 lw 1 lc rgb "gray40" title "ideal: unsharded / world", \
     data using 1:8 with linespoints lw 2 pt 4 dt 3 title "gradients, DDP + ZeRO-1 (every rank holds all)", \
     data using 1:9 with linespoints lw 2 pt 6 dt 3 title "gradients, DDP + ZeRO-2 (dtrain, after backward)"
