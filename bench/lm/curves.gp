# gnuplot -e "data='/tmp/lm/curves.dat'; out='bench/lm/state_precision.png'" bench/lm/curves.gp
# The validation losses bench/lm/curves.py tabulates (columns: step, then one per run), in the
# order bench/comparison.md's command gives the runs: dtrain AdamW with state in fp32, bf16
# (stochastic rounding), 8 bits, bf16 (rounded to nearest), then torchao's AdamW8bit in PyTorch.
set terminal pngcairo size 900,520 font ",10"
set output out
set datafile missing "?"
set key top right
set grid
set xlabel "step"
set ylabel "validation loss (4 fixed held-out batches)"
# Another set of runs names its own: -e "titles='a b c'" (one word per run, in column order).
if (!exists("titles")) titles = "dtrain-fp32 dtrain-bf16-stochastic dtrain-8-bit dtrain-bf16-nearest torchao-AdamW8bit"
if (!exists("plot_title")) plot_title = "Character GPT (1.9M parameters) on Debian's license texts: AdamW lr 1e-3, batch 16 x 128 bytes"
set title plot_title
plot for [k=1:words(titles)] data using 1:(column(k + 1)) with linespoints pt 7 ps 0.7 lw 2 title word(titles, k)
