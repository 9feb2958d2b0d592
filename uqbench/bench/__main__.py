from uqbench.bench import main

main()
