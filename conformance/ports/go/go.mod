module pipelinesport

go 1.19
