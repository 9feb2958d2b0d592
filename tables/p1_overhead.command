# p1_overhead.md, p1_overhead.tex, p1_overhead.csv were made by (run from the folder the paths are relative to):
uqbench-tables --runs runs --out tables --experiment p1_overhead
# from 30 results.json under runs:
#   p1_overhead/none/be_m16/llama2_7b/seed0/results.json
#   p1_overhead/none/be_m4/dino_vits16/seed0/results.json
#   p1_overhead/none/be_m4/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/be_m4/dinov2_vits14/seed0/results.json
#   p1_overhead/none/be_m8/bert_base/seed0/results.json
#   p1_overhead/none/de_m16/llama2_7b/seed0/results.json
#   p1_overhead/none/de_m4/dino_vits16/seed0/results.json
#   p1_overhead/none/de_m4/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/de_m4/dinov2_vits14/seed0/results.json
#   p1_overhead/none/de_m8/bert_base/seed0/results.json
#   p1_overhead/none/lora_all_m16_r8/llama2_7b/seed0/results.json
#   p1_overhead/none/lora_all_m4_r8/dino_vits16/seed0/results.json
#   p1_overhead/none/lora_all_m4_r8/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/lora_all_m4_r8/dinov2_vits14/seed0/results.json
#   p1_overhead/none/lora_all_m8_r8/bert_base/seed0/results.json
#   p1_overhead/none/lora_m16_r8/llama2_7b/seed0/results.json
#   p1_overhead/none/lora_m4_r8/dino_vits16/seed0/results.json
#   p1_overhead/none/lora_m4_r8/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/lora_m4_r8/dinov2_vits14/seed0/results.json
#   p1_overhead/none/lora_m8_r8/bert_base/seed0/results.json
#   p1_overhead/none/sve_m16/llama2_7b/seed0/results.json
#   p1_overhead/none/sve_m4/dino_vits16/seed0/results.json
#   p1_overhead/none/sve_m4/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/sve_m4/dinov2_vits14/seed0/results.json
#   p1_overhead/none/sve_m8/bert_base/seed0/results.json
#   p1_overhead/none/sve_split_m16/llama2_7b/seed0/results.json
#   p1_overhead/none/sve_split_m4/dino_vits16/seed0/results.json
#   p1_overhead/none/sve_split_m4/dinov2_vitb14/seed0/results.json
#   p1_overhead/none/sve_split_m4/dinov2_vits14/seed0/results.json
#   p1_overhead/none/sve_split_m8/bert_base/seed0/results.json
