module example.com/pipelines-port/go

go 1.19
