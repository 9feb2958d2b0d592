# p2_depth.md, p2_depth.tex, p2_depth.csv, p2_depth.png were made by (run from the folder the paths are relative to):
uqbench-tables --runs runs --out tables --experiment p2_depth
# from 24 results.json under runs:
#   p2_depth/polynomial/bnn_embedded/mlp_w16_d1/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w16_d2/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w16_d3/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w256_d1/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w256_d2/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w256_d3/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w4_d1/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w4_d2/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w4_d3/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w64_d1/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w64_d2/seed0/results.json
#   p2_depth/polynomial/bnn_embedded/mlp_w64_d3/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w16_d1/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w16_d2/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w16_d3/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w256_d1/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w256_d2/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w256_d3/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w4_d1/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w4_d2/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w4_d3/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w64_d1/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w64_d2/seed0/results.json
#   p2_depth/polynomial/bnn_learned/mlp_w64_d3/seed0/results.json
