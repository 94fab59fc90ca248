# gnuplot -e "data='state.dat'; out='bench/state_per_rank.png'" bench/state_per_rank.gp
# Columns of //bench:state_per_rank: world, unsharded, sorted-greedy max/min, flat max/min, ideal.
set terminal pngcairo size 900,560 font ",11"
set output out
set title "Adam state on the largest rank, GPT-2-shaped model (22.6M parameters, embedding 57%)"
set xlabel "ranks (world size)"
set ylabel "optimizer state per rank (MiB)"
set xrange [0.8:8.2]
set yrange [0:200]
set xtics 1
set grid
set key at graph 0.98, 0.88 right top opaque box
plot data using 1:2 with linespoints lw 2 pt 7 title "unsharded (every rank holds all)", \
     data using 1:3 with linespoints lw 2 pt 5 title "ZeRO sorted-greedy (PyTorch's partition)", \
     data using 1:5 with linespoints lw 2 pt 9 title "ZeRO flat (dtrain)", \
     data using 1:7 with lines dt 2 lw 1 lc rgb "gray40" title "ideal: unsharded / world"
